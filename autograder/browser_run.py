"""Every lesson run in JupyterLab in a real browser, as a learner runs it.

    /usr/bin/python3 autograder/browser_run.py [--out FOLDER] [--as-released] [LESSON ...]

Copies notebooks/ (the student release) into FOLDER/course, with each answer cell filled in
with the reference solution's answer (a learner who did the exercises; `--as-released`
leaves them as released, so that Run All stops at the first exercise), then starts
JupyterLab on that copy with the settings of `make lab` (lab/'s config, the checkout's
.venv kernel) and, in headless Chromium (Debian's `chromium` and `chromium-driver`, with
Selenium: run it with the system's /usr/bin/python3, as autograder/formgrader_check.py), for
each lesson (default: all):

1. opens the notebook, waits for its kernel, and runs Run > Run All Cells from the menu;
2. waits until every cell has run (the kernel idle, no cell queued);
3. saves screenshots into FOLDER/screens (the top of the notebook, each widget's output (five
   at most), three figures, the end), and saves the notebook (the course's save hook drops the live widget views);
4. reports from the saved notebook and the page: error outputs (an error that stopped Run All
   leaves code cells unrun; one the run went on past is a lesson's own demonstration), anything
   written to stderr, how many widgets rendered, and any "Error displaying widget".

Too slow for the test suite (every lesson runs, minutes each): run it after changing a
lesson, then LOOK at the screenshots. FOLDER defaults to autograder/work/browser, which git
ignores. Exit status 0 when no lesson showed an error.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from formgrader_check import browser, free_port, wait_for  # noqa: E402

VENV = ROOT / ".venv" / "bin"


def answered_copy(lesson: str, course: Path, as_released: bool) -> Path:
    """notebooks/LESSON copied into course/, its answer cells holding the solution's answers."""
    src = ROOT / "notebooks" / lesson
    dest = course / lesson
    shutil.copytree(src, dest, dirs_exist_ok=True)
    if as_released:
        return dest
    [path] = sorted(dest.glob("*.ipynb"))
    released = json.loads(path.read_text())
    solution = json.loads((ROOT / "solutions" / lesson / path.name).read_text())
    answers = {c["metadata"]["nbgrader"]["grade_id"]: "".join(c["source"]) for c in solution["cells"]
               if c["metadata"].get("nbgrader", {}).get("solution")}
    for cell in released["cells"]:
        grade = cell["metadata"].get("nbgrader", {})
        if grade.get("solution") and grade.get("grade_id") in answers:
            cell["source"] = "\n".join(line for line in answers[grade["grade_id"]].splitlines()
                                       if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
    path.write_text(json.dumps(released, indent=1))
    return dest


def start_lab(course: Path, port: int, token: str) -> subprocess.Popen:
    env = dict(os.environ, JUPYTER_PATH=str(ROOT / ".venv" / "share" / "jupyter"),
               JUPYTER_CONFIG_PATH=str(ROOT / "lab"), PATH=f"{VENV}:{os.environ.get('PATH', '')}")
    env.pop("GCLAB_SOURCE", None)
    return subprocess.Popen([str(VENV / "jupyter"), "lab", "--no-browser", f"--port={port}", "--allow-root",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={course}"],
                            cwd=course, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kernel_state(base: str, token: str, rel: str) -> str | None:
    """The execution state of the kernel of the notebook at `rel` (None while it has none)."""
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10) as reply:
        sessions = json.loads(reply.read())
    states = [s["kernel"]["execution_state"] for s in sessions if s.get("path") == rel and s.get("kernel")]
    return states[0] if states else None


def wait_until(condition, seconds: float, step: float = 1.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(step)
    return False


def click_menu(driver, menu: str, item: str) -> None:
    """Click `item` (its label) in the menu bar's `menu`, as a learner does."""
    from selenium.webdriver.common.by import By
    [label] = [e for e in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-itemLabel") if e.text == menu]
    label.click()
    time.sleep(0.5)
    [entry] = [e for e in driver.find_elements(By.CSS_SELECTOR, ".lm-Menu-itemLabel") if e.text == item]
    entry.click()


def scroll_to(driver, element) -> None:
    """Scroll the notebook so that `element` is near the top of the window."""
    driver.execute_script(
        "const el = arguments[0];"
        "const box = el.closest('.jp-WindowedPanel-outer') || document.querySelector('.jp-WindowedPanel-outer');"
        "box.scrollTop += el.getBoundingClientRect().top - box.getBoundingClientRect().top - 60;", element)
    time.sleep(1)


def queued(driver) -> int:
    """Cells waiting or running ([*]) in the notebook on screen."""
    return driver.execute_script(
        "return [...document.querySelectorAll('.jp-InputPrompt')].filter(e => e.textContent.includes('*')).length")


def run_lesson(driver, base: str, token: str, course: Path, lesson: str, screens: Path, timeout: float) -> dict:
    from selenium.webdriver.common.by import By
    [path] = sorted((course / lesson).glob("*.ipynb"))
    rel = path.relative_to(course).as_posix()
    driver.get(f"{base}/lab/tree/{rel}")
    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"), 60)
    wait_until(lambda: kernel_state(base, token, rel) == "idle", 120)
    time.sleep(2)
    for button in driver.find_elements(By.CSS_SELECTOR, ".jp-Notification-Toast button, .jp-toast-button"):
        if button.text.strip() == "No":                  # "get notified about official Jupyter news?"
            button.click()
    driver.save_screenshot(str(screens / f"{lesson}-0-top.png"))
    start = time.monotonic()
    click_menu(driver, "Run", "Run All Cells")
    time.sleep(3)
    settled = []

    def done():
        idle = kernel_state(base, token, rel) == "idle" and queued(driver) == 0
        settled.append(idle)
        return settled[-3:] == [True, True, True]
    finished = wait_until(done, timeout, step=2)
    seconds = time.monotonic() - start
    time.sleep(3)                                    # last figures and widgets draw
    widgets = driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output .jupyter-widgets.widget-container, "
                                                    ".jp-OutputArea-output .jupyter-widgets.widget-inline-hbox")
    for i, widget in enumerate(widgets[:5]):
        scroll_to(driver, widget)
        driver.save_screenshot(str(screens / f"{lesson}-{i + 1}-widget.png"))
    figures = driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output img")
    for i, figure in enumerate(figures[:: max(1, len(figures) // 3)][:3]):     # three figures, spread out
        scroll_to(driver, figure)
        driver.save_screenshot(str(screens / f"{lesson}-{i + 6}-figure.png"))
    page = driver.find_element(By.TAG_NAME, "body").text
    last = driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-CodeCell")
    if last:
        scroll_to(driver, last[-1])
    driver.save_screenshot(str(screens / f"{lesson}-9-end.png"))
    images = len(driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output img"))
    click_menu(driver, "File", "Save Notebook")
    time.sleep(3)
    click_menu(driver, "Kernel", "Shut Down Kernel")
    time.sleep(2)
    for button in driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog .jp-mod-accept"):
        button.click()
    time.sleep(1)
    click_menu(driver, "File", "Close Tab")           # the next lesson's panel is then the only one
    time.sleep(1)
    report = {"lesson": lesson, "finished": finished, "seconds": round(seconds), "widgets": len(widgets),
              "images": images, "widget_errors": page.count("Error displaying widget")}
    report.update(saved_outputs(path))
    return report


def saved_outputs(path: Path) -> dict:
    """Errors, stderr and unrun code cells of the notebook as the browser saved it."""
    nb = json.loads(path.read_text())
    errors, stderr, unrun = [], [], 0
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        if cell.get("execution_count") is None and "".join(cell["source"]).strip():
            unrun += 1
        for out in cell.get("outputs", []):
            if out["output_type"] == "error":
                errors.append(f"cell {i}: {out['ename']}: {out['evalue'][:300]}")
            elif out.get("name") == "stderr":
                stderr.append(f"cell {i}: {''.join(out['text']).strip()[:300]}")
    return {"errors": errors, "stderr": stderr, "unrun_code_cells": unrun}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lessons", nargs="*", help="lesson folders of notebooks/ (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "autograder" / "work" / "browser")
    parser.add_argument("--as-released", action="store_true", help="leave the answer cells as released")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a lesson may take to run")
    args = parser.parse_args(argv)
    lessons = args.lessons or [p.name for p in sorted((ROOT / "notebooks").iterdir()) if p.is_dir()]
    out = args.out.resolve()
    course, screens = out / "course", out / "screens"
    shutil.rmtree(out, ignore_errors=True)
    course.mkdir(parents=True)
    screens.mkdir()
    for lesson in lessons:
        answered_copy(lesson, course, args.as_released)
    port, token = free_port(), secrets.token_hex(8)
    base = f"http://127.0.0.1:{port}"
    server = start_lab(course, port, token)
    ok = True
    try:
        wait_for(f"{base}/api/status?token={token}", 120)
        driver = browser()
        try:
            driver.get(f"{base}/lab?reset&token={token}")    # the token, once: a cookie for the pages after;
                                                             # reset: no tabs restored from an earlier run
            time.sleep(5)
            for lesson in lessons:
                report = run_lesson(driver, base, token, course, lesson, screens, args.timeout)
                # an error shown by a cell the run went on past is the lesson's own demonstration (lesson 01
                # shows a failed cell's traceback); an error that stopped Run All leaves later cells unrun
                bad = (not report["finished"] or report["stderr"] or report["widget_errors"]
                       or (report["unrun_code_cells"] and not args.as_released))
                ok &= not bad
                print(json.dumps(report), flush=True)
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"screenshots in {screens}; {'no lesson showed an error' if ok else 'PROBLEMS above'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
