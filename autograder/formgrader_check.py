"""The Formgrader in a real browser, after a class was graded (by `nbgrader autograde` or `make grade-class`):
the students' names, the scores the course's grader gave, a submission's view, and a feedback page.

    /usr/bin/python3 autograder/formgrader_check.py COURSE --out FOLDER [--assignment toy]

Starts a Jupyter server with nbgrader's Formgrader on COURSE (its autograder/nbgrader_config.py, as
`make lab AUTHOR=1` does), opens its pages in headless Chromium (Debian's `chromium` and `chromium-driver`,
and Selenium: `apt install chromium chromium-driver python3-selenium`, run with the system's /usr/bin/python3),
saves a screenshot of each into FOLDER and prints what each page shows.  It writes nothing into COURSE.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VENV = Path(__file__).resolve().parent.parent / ".venv" / "bin"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(course: Path, port: int, token: str) -> subprocess.Popen:
    env = dict(os.environ, JUPYTER_CONFIG_PATH=str(course / "autograder"))
    return subprocess.Popen([str(VENV / "jupyter"), "server", "--no-browser", f"--port={port}", "--allow-root",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={course}"],
                            cwd=course / "autograder", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for(url: str, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server did not answer at {url}")


def api(base: str, token: str, path: str):
    with urllib.request.urlopen(f"{base}/formgrader/api/{path}?token={token}", timeout=30) as reply:
        return json.loads(reply.read())


def browser():
    from selenium import webdriver
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.binary_location = "/usr/bin/chromium"
    from selenium.webdriver.chrome.service import Service
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def shoot(driver, url: str, out: Path, name: str, settle: float = 4) -> str:
    """Open `url`, wait for its scripts, save a screenshot; the page's visible text."""
    driver.get(url)
    time.sleep(settle)
    driver.save_screenshot(str(out / f"{name}.png"))
    return driver.find_element("tag name", "body").text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("course", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--assignment", default="toy")
    args = parser.parse_args(argv)
    course, out = args.course.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    port, token = free_port(), secrets.token_hex(8)
    base = f"http://127.0.0.1:{port}"
    server = start_server(course, port, token)
    try:
        wait_for(f"{base}/api/status?token={token}")
        driver = browser()
        try:
            driver.get(f"{base}/?token={token}")           # the token, once: a cookie for the pages after
            students = shoot(driver, f"{base}/formgrader/manage_students", out, "students")
            print("== Manage Students ==\n" + students)
            listed = shoot(driver, f"{base}/formgrader/manage_submissions/{args.assignment}", out, "submissions")
            print(f"== Manage Submissions: {args.assignment} ==\n" + listed)
            for row in api(base, token, f"submissions/{args.assignment}"):
                print(f"api: {row['student']} ({row.get('first_name')} {row.get('last_name')}): "
                      f"{row['score']:g} / {row['max_score']:g}, autograded {row['autograded']}")
            notebooks = api(base, token, f"submitted_notebooks/{args.assignment}/{args.assignment}")
            first = next((n for n in notebooks if n.get("id")), None)
            if first:
                view = shoot(driver, f"{base}/formgrader/submissions/{first['id']}", out, "submission", settle=6)
                print(f"== a submission's view ({first['student']}) ==\n" + view[:3000])
            pages = sorted((course / "feedback").glob(f"*/{args.assignment}/*.html"), key=lambda p: -p.stat().st_size)
            for page in pages[:1]:                          # the longest: the likeliest to run off the edge
                text = shoot(driver, page.as_uri(), out, "feedback", settle=1)
                width = driver.execute_script("return document.documentElement.scrollWidth")
                print(f"== feedback page {page.relative_to(course)} ==\npage width {width}px in a 1400px window "
                      f"(a line running off the right edge makes it wider)\n" + text[:2000])
        finally:
            driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"screenshots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
