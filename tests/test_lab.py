"""`make lab` as a learner finds it: JupyterLab, started headless on 127.0.0.1 by the Makefile's
own target, offers only the course's kernel (this checkout's .venv, the one every notebook
names), and nbgrader's author tools only with AUTHOR=1."""
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gclab.grader import course

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "gclab-lab-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, port, proc, log):
        self.port, self.proc, self.log = port, proc, log

    def get(self, path):
        url = f"http://127.0.0.1:{self.port}{path}{'&' if '?' in path else '?'}token={TOKEN}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    def send(self, method, path, body=None):
        url = f"http://127.0.0.1:{self.port}{path}?token={TOKEN}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()

    def page_config(self):
        status, html = self.get("/lab")
        assert status == 200
        data = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', html, re.S)
        return json.loads(data.group(1))

    def kernelspecs(self):
        return json.loads(self.get("/api/kernelspecs")[1])["kernelspecs"]


def start_lab(tmp_path, *make_args):
    """`make lab` with a token, on a free port of 127.0.0.1, no browser; Jupyter's per-user folders
    in tmp_path (as a learner's would be, empty); stopped by the caller."""
    port = _free_port()
    lab_args = (f"--no-browser --allow-root --ServerApp.ip=127.0.0.1 --ServerApp.port={port} "
                f"--ServerApp.port_retries=0 --IdentityProvider.token={TOKEN}")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JUPYTER", "VIRTUAL_ENV")) and k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(HOME=str(tmp_path), JUPYTER_CONFIG_DIR=str(tmp_path / ".jupyter"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    # what a learner may have for their whole user account: a python3 kernel of another Python,
    # and the "gclab" kernel earlier versions of the Makefile registered (of whichever checkout ran last)
    for name, display in (("python3", "Python 3 (some other Python)"), ("gclab", "Python (gclab)")):
        spec = tmp_path / "data" / "kernels" / name
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": display, "language": "python"}))
    log = tmp_path / "lab.log"
    # -o: the .venv as it is (make test made it); the kernel's stamp is remade if stale
    proc = subprocess.Popen(["make", "-o", ".venv/.installed", "lab", f"LAB_ARGS={lab_args}", *make_args],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    lab = Lab(port, proc, log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, "make lab ended:\n" + log.read_text()[-3000:]
        try:
            if lab.get("/api/status")[0] == 200:
                return lab
        except OSError:
            pass
        time.sleep(0.5)
    stop(lab)
    pytest.fail("JupyterLab did not answer within 90 s:\n" + log.read_text()[-3000:])


def stop(lab):
    try:
        os.killpg(lab.proc.pid, signal.SIGTERM)
        lab.proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(lab.proc.pid, signal.SIGKILL)
        lab.proc.wait(10)


# A notebook as the lab holds it after a cell showed an Explorer: the widget's live view, and its figure
WITH_A_WIDGET = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{
    "cell_type": "code", "execution_count": 1, "id": "explorer", "metadata": {}, "source": "explorer",
    "outputs": [
        {"output_type": "display_data", "metadata": {},
         "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "0f", "version_major": 2, "version_minor": 0},
                  "text/plain": "VBox(...)"}},
        {"output_type": "display_data", "metadata": {}, "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}}]}]}


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    lab = start_lab(tmp_path_factory.mktemp("learner"))
    try:
        result = {"kernels": lab.kernelspecs(), "page": lab.page_config(), "formgrader": lab.get("/formgrader")[0],
                  "extensions": lab.get("/lab/api/extensions"),
                  "notebook_settings": lab.get("/lab/api/settings/@jupyterlab/notebook-extension:tracker")}
    finally:
        stop(lab)
    result["log"] = lab.log.read_text()
    return result


@pytest.fixture(scope="module")
def author(tmp_path_factory):
    lab = start_lab(tmp_path_factory.mktemp("author"), "AUTHOR=1")
    try:
        result = {"kernels": lab.kernelspecs(), "page": lab.page_config(), "formgrader": lab.get("/formgrader")[0]}
        result["manage"] = lab.get("/formgrader/manage_assignments")
    finally:
        stop(lab)
    result["log"] = lab.log.read_text()
    return result


def test_the_lab_offers_the_kernel_of_this_checkout_the_notebooks_name(learner):
    assert set(learner["kernels"]) == {course.KERNEL_NAME}
    spec = learner["kernels"][course.KERNEL_NAME]["spec"]
    assert spec["display_name"] == course.KERNEL_DISPLAY_NAME
    assert Path(spec["argv"][0]) == ROOT / ".venv" / "bin" / "python"


def test_the_learners_lab_wraps_long_code_lines(learner):
    """A self-check's message can be a long line: wrapped, it reads without scrolling sideways."""
    status, body = learner["notebook_settings"]
    assert status == 200
    defaults = json.loads(body)["schema"]["properties"]["codeCellConfig"]["default"]     # the overrides land here
    assert defaults["lineWrap"] is True


def test_the_learners_lab_has_no_author_tools(learner):
    assert learner["page"]["disabledExtensions"] == ["@jupyter/nbgrader"]
    assert learner["formgrader"] == 404                         # nbgrader's server extensions are off
    assert "nbgrader" not in learner["log"]
    status, body = learner["extensions"]
    if status == 200:                                           # the extension manager agrees
        listed = json.loads(body)
        listed = listed["installed"] if isinstance(listed, dict) else listed
        assert [e["enabled"] for e in listed if "nbgrader" in e["name"]] == [False]


def test_author_mode_has_nbgrader_with_the_course_config(author):
    assert "@jupyter/nbgrader" not in author["page"]["disabledExtensions"]
    assert author["formgrader"] == 200
    status, html = author["manage"]
    assert status == 200 and "gc-gpu-memory" in html and "sqlite:///" + str(ROOT / "autograder") in html  # the course's config
    assert "No nbgrader_config.py file found" not in author["log"]
    assert author["kernels"][course.KERNEL_NAME]["spec"]["display_name"] == course.KERNEL_DISPLAY_NAME


def test_a_saved_lesson_keeps_each_widgets_figure_and_not_its_live_view(tmp_path):
    """Saved through a Jupyter server with the learner's settings (lab/, as `make lab` starts it, here in a
    scratch folder rather than notebooks/), a notebook loses the outputs that show a live widget (their state is
    in the kernel: reopened without it, each would read "Error displaying widget: model not found") and keeps the
    static figure each widget leaves beside it."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    env.update(HOME=str(tmp_path), JUPYTER_CONFIG_PATH=str(ROOT / "lab"), JUPYTER_CONFIG_DIR=str(tmp_path / ".jupyter"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    (tmp_path / "work").mkdir()
    log = tmp_path / "server.log"
    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "jupyter"), "server", "--no-browser", "--allow-root",
                             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
                             f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={tmp_path / 'work'}"],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    server = Lab(port, proc, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if server.get("/api/status")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        server.send("PUT", "/api/contents/saved.ipynb", {"type": "notebook", "format": "json", "content": WITH_A_WIDGET})
        outputs = json.loads((tmp_path / "work" / "saved.ipynb").read_text())["cells"][0]["outputs"]
    finally:
        stop(server)
    assert [sorted(o["data"]) for o in outputs] == [["image/png", "text/plain"]], outputs
