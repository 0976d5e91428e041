"""The agent: one long-lived process inside each sandbox that runs its commands.

It is run by the sandbox's own ``python3`` (standard library only, any Python 3.9+), as the
sandbox's unprivileged user, and speaks frames over its stdin/stdout: a 4-byte big-endian
length, then a JSON object. One request at a time, one reply each:

    {"op": "exec", "cmd": "ls" | ["ls", "-l"], "cwd": ..., "env": {...}, "stdin": B64,
     "timeout_s": 5, "max_output_bytes": 65536}
      -> {"ok": true, "exit_code": 0, "stdout": B64, "stderr": B64, "stdout_truncated": false,
          "stderr_truncated": false, "timed_out": false, "duration_s": 0.01}
    {"op": "write_file", "path": ..., "data": B64, "mode": 420}   -> {"ok": true, "size_bytes": N}
    {"op": "read_file", "path": ..., "max_bytes": N}               -> {"ok": true, "data": B64}
    {"op": "configure", "env": {...}, "workdir": "/work", "limits": {...},
     "model_port": 8377, "model_socket": "/run/flywheel/model.sock"} -> {"ok": true}
    errors                                                        -> {"ok": false, "error": "..."}

Why a resident agent: an exec then costs a fork of bash, not a new sandbox (a few ms, not
tens). A string ``cmd`` runs in ``bash -c``; the folder it ends in is the next exec's
working folder, so a session behaves like a shell. An argv list runs without a shell.

Each exec runs in its own session with the sandbox's rlimits (inherited from the agent, so
nothing runs between fork and exec); when it exits or its timeout passes, the agent sends
SIGKILL to every other process it may signal (``kill(-1)``), which in the sandbox's own PID
namespace is everything the command left behind, background jobs and daemons included. The
agent makes itself non-dumpable, so the commands it runs (same user) cannot ptrace it or
read its file descriptors. On the local backend they can still kill it, which ends the
sandbox (the service then reports it gone); on docker it is PID 1, which the kernel shields
from signals sent inside. The service enforces every timeout again from outside, so a hung
or killed agent never holds a command past its deadline.

A sandbox configured with ``model_port`` (its spec has a ``model_url``) has one way out: a
thread of the agent listens on ``127.0.0.1:model_port`` in the sandbox's own loopback and
copies each connection, both ways, to the Unix socket the service bound in at
``model_socket``, where the service's relay forwards requests to the model endpoint and
nothing else (``relay.py``).
"""

import base64
import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

READ_CHUNK = 65536
# The shell prints its final folder on fd N when it exits, so cwd carries over between execs.
SHELL_WRAPPER = 'trap "pwd >&{fd} 2>/dev/null" EXIT; eval "$1"'
RLIMITS = {  # limits key -> resource
    "nproc": resource.RLIMIT_NPROC,
    "fsize_bytes": resource.RLIMIT_FSIZE,
    "as_bytes": resource.RLIMIT_AS,
    "nofile": resource.RLIMIT_NOFILE,
}


def make_undumpable():
    try:
        # imported here: a python built without _ctypes (some minimal images) still runs the
        # agent, without this hardening
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (ImportError, OSError, AttributeError):
        pass


class Agent:
    def __init__(self):
        self.env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8"}
        if os.environ.get("PYTHONPATH"):  # the backend's shared packages (the agent itself, run -I, ignores them)
            self.env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.cwd = "/work"

    def configure(self, req):
        """Session env and workdir; the sandbox's rlimits, set on the agent itself so that every
        command inherits them (no code between fork and exec: the fast vfork path)."""
        self.env.update(req.get("env") or {})
        if req.get("workdir"):
            self.cwd = req["workdir"]
            self.env["HOME"] = req["workdir"]
        for key, value in (req.get("limits") or {}).items():
            resource.setrlimit(RLIMITS[key], (value, value))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if req.get("model_port"):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", int(req["model_port"])))
            listener.listen(64)
            threading.Thread(target=ModelForwarder(listener, req["model_socket"]).run, daemon=True).start()
        return {"ok": True}

    @staticmethod
    def _limit_command(pid, timeout_s):
        """CPU seconds (a backstop: the deadline kills first) and the OOM killer's first pick."""
        try:
            cpu_s = int(timeout_s) + 1
            resource.prlimit(pid, resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
            with open(f"/proc/{pid}/oom_score_adj", "w") as f:
                f.write("1000")
        except (OSError, ProcessLookupError):  # already exited
            pass

    def _path(self, path):
        return path if path.startswith("/") else os.path.join(self.cwd, path)

    def exec(self, req):
        timeout_s = float(req.get("timeout_s") or 30.0)
        max_out = int(req.get("max_output_bytes") or 65536)
        env = dict(self.env)
        env.update(req.get("env") or {})
        if not req.get("cwd") and not os.path.isdir(self.cwd):
            self.cwd = self.env["HOME"]  # the folder the last command ended in is gone: start over
        cwd = self._path(req["cwd"]) if req.get("cwd") else self.cwd
        cmd = req["cmd"]
        cwd_r = cwd_w = None
        if isinstance(cmd, str):
            cwd_r, cwd_w = os.pipe()
            argv = ["/bin/bash", "-c", SHELL_WRAPPER.format(fd=cwd_w), "bash", cmd]
        else:
            argv = list(cmd)
        stdin = base64.b64decode(req.get("stdin") or "")
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                pass_fds=(cwd_w,) if cwd_w is not None else ())
        except OSError as exc:
            for fd in (cwd_r, cwd_w):
                if fd is not None:
                    os.close(fd)
            why = f"{exc.filename or argv[0]}: {exc.strerror}\n"
            return {"ok": True, "exit_code": 127, "stdout": "", "stderr": _b64(why.encode()),
                    "stdout_truncated": False, "stderr_truncated": False, "timed_out": False,
                    "duration_s": time.monotonic() - started}
        if cwd_w is not None:
            os.close(cwd_w)
        self._limit_command(proc.pid, timeout_s)
        out, timed_out = self._collect(proc, stdin, max_out, started + timeout_s)
        exit_code = proc.wait()
        self._await_no_others()
        if cwd_r is not None:
            os.set_blocking(cwd_r, False)
            try:
                final = os.read(cwd_r, 4096).decode(errors="replace").strip().splitlines()
            except BlockingIOError:
                final = []
            os.close(cwd_r)
            if final and not timed_out:
                self.cwd = final[-1]
        return {"ok": True, "exit_code": exit_code, "stdout": _b64(out[0][0]), "stderr": _b64(out[1][0]),
                "stdout_truncated": out[0][1], "stderr_truncated": out[1][1], "timed_out": timed_out,
                "duration_s": time.monotonic() - started}

    def _collect(self, proc, stdin, max_out, deadline):
        """Read stdout/stderr until the command exits (then kill what it left) or the deadline."""
        bufs = {proc.stdout.fileno(): [bytearray(), False], proc.stderr.fileno(): [bytearray(), False]}
        order = [proc.stdout.fileno(), proc.stderr.fileno()]
        sel = selectors.DefaultSelector()
        for fd in order:
            sel.register(fd, selectors.EVENT_READ)
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ)
        if stdin:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        pending = memoryview(stdin)
        timed_out = killed = False
        running = True
        while running or any(fd in sel.get_map() for fd in order):
            if not killed and time.monotonic() >= deadline:
                timed_out = killed = True
                self._kill_all()
            wait_s = 1.0 if killed else max(deadline - time.monotonic(), 0.0)
            ready = sel.select(wait_s)
            if killed and not ready:
                break  # nothing more can arrive: every process that held a pipe is dead
            for key, _ in ready:
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    running = False
                    if not killed:  # the command is done: what it left behind goes too
                        killed = True
                        self._kill_all()
                elif fd in bufs:
                    try:
                        chunk = os.read(fd, READ_CHUNK)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    buf = bufs[fd]
                    room = max_out - len(buf[0])
                    buf[0] += chunk[:room]
                    if len(chunk) > room:
                        buf[1] = True
                else:
                    try:
                        sent = os.write(fd, pending[:READ_CHUNK])
                    except OSError:  # the command closed its stdin
                        sent = len(pending)
                    pending = pending[sent:]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
        os.close(pidfd)
        sel.close()
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()
        return [bufs[order[0]], bufs[order[1]]], timed_out

    @staticmethod
    def _kill_all():
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _await_no_others(self, timeout_s=2.0):
        """Reply only once every process the command left is gone (killed ones may still be
        zombies for a moment, until their reaper - bwrap's init, or this agent as PID 1 - waits)."""
        me = os.getpid()
        deadline = time.monotonic() + timeout_s
        while True:
            self._reap()
            others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
            if not others or time.monotonic() > deadline:
                return
            time.sleep(0.0005)

    @staticmethod
    def _reap():
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def write_file(self, req):
        path = self._path(req["path"])
        data = base64.b64decode(req["data"])
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _mode(req))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.chmod(path, _mode(req))
        return {"ok": True, "size_bytes": len(data)}

    def read_file(self, req):
        path = self._path(req["path"])
        max_bytes = int(req["max_bytes"])
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            return {"ok": False, "error": f"{req['path']}: larger than {max_bytes} bytes", "kind": "too_large"}
        return {"ok": True, "data": _b64(data)}


class ModelForwarder:
    """Copies each connection to the model port, both ways, to the service's relay socket: one
    thread, non-blocking sockets, a selector (threads per connection would count against the
    sandbox's process limit). When one side is done sending, the other is shut down for writing
    once all it sent is through; a pair is closed when both directions are done or either fails."""

    def __init__(self, listener, socket_path):
        self.listener = listener
        self.socket_path = socket_path
        self.selector = selectors.DefaultSelector()
        self.peer = {}  # socket -> the socket it is paired with
        self.pending = {}  # socket -> bytes still to write to it
        self.eof = set()  # sockets that will send nothing more
        self.shut = set()  # sockets shut down for writing

    def run(self):
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        while True:
            for key, mask in self.selector.select():
                sock = key.fileobj
                if sock is self.listener:
                    self._accept()
                    continue
                try:
                    if mask & selectors.EVENT_READ and sock in self.peer:
                        self._read(sock)
                    if mask & selectors.EVENT_WRITE and sock in self.peer:
                        self._flush(sock)
                except OSError:
                    self._close(sock)

    def _accept(self):
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        relay = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            relay.connect(self.socket_path)
        except OSError:
            client.close()
            relay.close()
            return
        for sock, other in ((client, relay), (relay, client)):
            sock.setblocking(False)
            self.peer[sock], self.pending[sock] = other, b""
            self.selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock):
        try:
            data = sock.recv(READ_CHUNK)
        except BlockingIOError:
            return
        if not data:
            self.eof.add(sock)
        self.pending[self.peer[sock]] += data
        self._flush(self.peer[sock])
        self._watch(sock)

    def _flush(self, sock):
        """Write what is pending to ``sock``; shut it for writing once its peer is done."""
        data = self.pending[sock]
        if data:
            try:
                data = data[sock.send(data):]
            except BlockingIOError:
                pass
            self.pending[sock] = data
        if not data and self.peer[sock] in self.eof and sock not in self.shut:
            sock.shutdown(socket.SHUT_WR)
            self.shut.add(sock)
        if all(s in self.eof and s in self.shut for s in (sock, self.peer[sock])):
            self._close(sock)
            return
        self._watch(sock)

    def _watch(self, sock):
        if sock not in self.peer:
            return
        events = 0 if sock in self.eof else selectors.EVENT_READ
        if self.pending[sock]:
            events |= selectors.EVENT_WRITE
        try:
            self.selector.get_key(sock)
            registered = True
        except KeyError:
            registered = False
        if events and registered:
            self.selector.modify(sock, events)
        elif events:
            self.selector.register(sock, events)
        elif registered:
            self.selector.unregister(sock)

    def _close(self, sock):
        """Close ``sock`` and its peer, and forget both."""
        for s in (sock, self.peer.get(sock)):
            if s is None or s not in self.peer:
                continue
            try:
                self.selector.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
            del self.peer[s], self.pending[s]
            self.eof.discard(s)
            self.shut.discard(s)


def _b64(data):
    return base64.b64encode(bytes(data)).decode("ascii")


def _read_exact(stream, n):
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _mode(req):
    """The file mode asked for (0 is a mode, not a missing one); 0o644 when none is given."""
    mode = req.get("mode")
    return 0o644 if mode is None else int(mode)


def main():
    make_undumpable()
    # A command that exits without reading its stdin must not take the agent with it: writing to
    # its closed pipe fails (EPIPE, handled) instead of killing the agent. Commands get the
    # default back (Popen restores SIGPIPE); a closed channel to the service still ends the
    # agent (its reply write raises).
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # Past RLIMIT_FSIZE a write fails (EFBIG) instead of killing the agent; commands get the
    # default back (Popen restores SIGXFSZ).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    agent = Agent()
    ops = {"exec": agent.exec, "write_file": agent.write_file, "read_file": agent.read_file,
           "configure": agent.configure}
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(struct.pack(">I", 2) + b"{}")  # ready
    out.flush()
    while True:
        header = _read_exact(inp, 4)
        if header is None:
            return
        body = _read_exact(inp, struct.unpack(">I", header)[0])
        if body is None:
            return
        try:
            req = json.loads(body)
            reply = ops[req["op"]](req)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "kind": "failed"}
        data = json.dumps(reply).encode()
        out.write(struct.pack(">I", len(data)) + data)
        out.flush()


if __name__ == "__main__":
    main()
