"""gclab.zygote.show_as: a process shown as started with another command line, as ps and psutil read it."""
import subprocess
import sys

SHOWN = """
import sys
from gclab import zygote
print(zygote.show_as(sys.argv[2:4], name="jupyter-lab"), zygote.show_as(["x" * 4096]))
print(repr(open("/proc/self/cmdline", "rb").read()), open("/proc/self/comm").read().strip())
"""


def test_a_process_is_shown_with_the_command_line_it_is_given_where_it_fits():
    done = subprocess.run([sys.executable, "-c", SHOWN, "-" * 60, "python", "/venv/bin/jupyter-lab"],
                          capture_output=True, text=True, timeout=60)
    fits, shown = done.stdout.splitlines()
    assert fits == "True False", done.stdout + done.stderr        # the second, longer than the first, does not fit
    cmdline, comm = shown.rsplit(" ", 1)
    assert eval(cmdline).rstrip(b"\0").split(b"\0") == [b"python", b"/venv/bin/jupyter-lab"] and comm == "jupyter-lab"
