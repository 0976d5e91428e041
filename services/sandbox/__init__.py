"""Sandbox: runs untrusted, model-written code for tools and verifiers, over NATS request/reply.

    backends.py        the local backend (bubblewrap)
    backend_docker.py  the docker backend (docker SDK)
    sessions.py        live sandboxes: TTL, idle TTL, exec timeout, warm pool, caps
    service.py         the NATS responder on sandbox.*, and the composition root
    __main__.py        ``python -m flywheel_sandbox``

The client and the messages are in :mod:`flywheel.sdk.sandbox`; the process inside each sandbox
(``agent.py``), the agent channel, bubblewrap's command line, cgroups and the model relay
(``relay.py``) are in :mod:`flywheel.runtime`, which environment workers share.

What is isolated, on both backends: a sandbox has no network (only its own loopback; the
host's loopback services, NATS and PostgreSQL included, are unreachable), and a spec asking
for network (``network=True``) is refused with kind ``invalid_request`` unless the service's
own setting ``sandbox_allow_network`` (``FLYWHEEL_SANDBOX_ALLOW_NETWORK``) is on: a bus
client cannot give itself network. It sees none of the host's files except a read-only
system (local: the host's ``/usr``; docker: the image), and can write only three tmpfs
mounts of ``disk_mb`` each: the workdir ``/work``, ``/tmp`` and ``/dev/shm`` (POSIX shared
memory); everything else, its root, ``/etc`` and ``/dev`` included, is read-only (a write
fails with EROFS or EACCES, and no new top-level folder can be made; its own processes'
entries in ``/proc`` aside). It sees and can signal
only its own processes, runs as an unprivileged user with no capabilities and no way to gain
any (no setuid root, no sudo, no new user namespaces where the backend can refuse them), and
is held to its memory, process and CPU limits. Whatever a command leaves running is killed
when its exec returns, and a command past its ``timeout_s`` is killed with everything it
started.

What is not isolated: the kernel is shared with the host (no seccomp filter and no VM: a
kernel exploit escapes); the local backend shows the host's ``/usr`` (readable, not
writable) and limits CPU time only where it may create cgroups; where the service allows
network, a spec with ``network=True`` gets it (local: the host's network namespace, loopback
services included; docker: the engine's default bridge); a spec with a ``model_url`` (either
backend) reaches that URL's paths, through the service's model relay (``relay.py``), and no
other; the packages of setting ``sandbox_python_path`` are readable (local backend; by
default the service's own site-packages); the commands of one sandbox run as
the same user as its agent, so they can kill it (the sandbox then ends) or forge their own
output, but nothing outside the sandbox. Several
sandboxes share the machine's CPU, memory bandwidth and disk bandwidth (no I/O limits).
The local backend gives each sandbox a user id and cgroups of its own only when the service
runs as root; run as another user, its sandboxes share that user's id, with no process limit.
"""
