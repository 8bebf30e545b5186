"""A process tree for the host sampler tests, run as a script: the root of a job.

Reads one command per line on stdin and answers each with a line on stdout:
``alloc <MiB>`` starts a child that fills that much memory (every page touched) and
sleeps, ``spin`` starts a child that keeps one core busy, ``stop`` ends and reaps the
newest child; each answers the child's pid once it is ready. At end of input every
child is killed. Children end by themselves after two minutes, whatever happens.
"""

import subprocess
import sys

CHILDREN = {
    "alloc": (
        "import sys, time\n"
        "block = bytearray(b'\\x01') * (int(sys.argv[1]) * 1024 * 1024)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    ),
    "spin": (
        "import time\n"
        "print('ready', flush=True)\n"
        "end = time.monotonic() + 120\n"
        "while time.monotonic() < end:\n"
        "    pass\n"
    ),
}


def main() -> None:
    children: list[subprocess.Popen[str]] = []
    for line in sys.stdin:
        command, *args = line.split()
        if command == "stop":
            child = children.pop()
            child.kill()
            child.wait()
            print(child.pid, flush=True)
            continue
        child = subprocess.Popen(
            [sys.executable, "-c", CHILDREN[command], *args], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        children.append(child)
        print(child.pid, flush=True)
    for child in children:
        child.kill()
        child.wait()


if __name__ == "__main__":
    main()
