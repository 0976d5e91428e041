"""A unit-test runner that goes into a sandbox with the code under test (stdlib only, Python 3.8+).

``python3 sandbox_test_runner.py TEST_FILE < NONCE`` imports ``TEST_FILE`` (which imports the
code under test) and calls each of its top-level ``test_*`` functions in file order, each with
its own deadline (``FLYWHEEL_TEST_TIMEOUT_S``, default 5 s; SIGALRM, so a Python loop that never
ends fails that test and the next one runs). It prints one line per test, marked with the
nonce read from stdin (what the code under test prints goes to stderr, and the nonce keeps
anything it writes to stdout anyway from being taken for a verdict)::

    <nonce> pass test_empty
    <nonce> fail test_unicode AssertionError: expected 'ba', got 'ab'
    <nonce> timeout test_large

A test file that does not import (a syntax error in the code under test, an exception at
import) fails every test with that error. :func:`flywheel.sdk.sandbox_tools.run_tests` writes
this file beside the tests, runs it and counts the lines.

Not covered: the code under test runs in this process, so code written to game its tests
(patching the runner, objects that equal anything) can forge passes; the nonce only keeps
honest output from being misread. A loop in C code that never returns to Python is stopped by
the whole run's timeout, not by the per-test deadline.
"""

import ast
import os
import signal
import sys
import traceback


class DeadlinePassed(BaseException):
    """Raised in a test at its deadline (a BaseException, so ``except Exception`` cannot hold it)."""


def _alarm(signum, frame):
    raise DeadlinePassed()


def collect_tests(source):
    """The top-level ``test*`` functions of a test file's source, in order (not async ones)."""
    tree = ast.parse(source)
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]


def describe(exc):
    """One line: the exception and, for a failed assert, its message or the failing line."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip().replace("\n", " | ")
    if isinstance(exc, AssertionError) and not str(exc):
        frames = traceback.extract_tb(exc.__traceback__)
        if frames and frames[-1].line:
            text = "AssertionError: " + frames[-1].line.strip()
    return text[:500]


def main():
    nonce = sys.stdin.readline().strip()
    sys.stdin = open(os.devnull)
    path = sys.argv[1]
    timeout_s = float(os.environ.get("FLYWHEEL_TEST_TIMEOUT_S", "5"))
    # Verdicts alone on stdout: what the code under test prints goes to stderr.
    out = sys.stdout
    sys.stdout = sys.stderr

    def say(verdict, name, detail=""):
        out.write(f"\n{nonce} {verdict} {name} {detail}\n")
        out.flush()

    with open(path) as f:
        names = collect_tests(f.read())
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    signal.signal(signal.SIGALRM, _alarm)
    module = {"__name__": "tests_under_run", "__file__": path}
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), module)
    except DeadlinePassed:
        for name in names:
            say("timeout", name, f"importing the tests ran past {timeout_s:g} s")
        return
    except BaseException as exc:
        for name in names:
            say("fail", name, "import failed: " + describe(exc))
        return
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    for name in names:
        fn = module.get(name)
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                fn()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except DeadlinePassed:
            say("timeout", name, f"ran past {timeout_s:g} s")
        except BaseException as exc:
            say("fail", name, describe(exc))
        else:
            say("pass", name)


if __name__ == "__main__":
    main()
