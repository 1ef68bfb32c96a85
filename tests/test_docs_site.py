"""The documentation site: a strict MkDocs build, the built pages in headless Chromium, the
generated reference against the code, and the getting-started pages' commands run as written.

The site is built once per module (``mkdocs build --strict`` with this interpreter's mkdocs,
from the repository root, into a temporary directory); the other tests read that build. The
browser tests serve it over HTTP on 127.0.0.1 (Material's search needs http, not file://) and
drive Chromium through selenium and chromedriver, found (or installed) by scripts/chromium.sh as
tests/test_dashboard_browser.py does; they skip, saying why, where there is no Chromium.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import click
import pytest
from conftest import REPO

BUILD_TIMEOUT_S = 240
COMMAND_TIMEOUT_S = 120
NAV_SECTIONS = (
    "Getting started",
    "Launching",
    "Collective training",
    "Elastic jobs",
    "Parameter server",
    "Schedulers",
    "Observability",
    "Troubleshooting",
    "Migrating",
    "Reference",
    "Architecture",
    "Benchmarks",
)


# ---------------------------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strictly (any warning fails) into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    try:
        r = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"mkdocs build --strict did not finish in {BUILD_TIMEOUT_S} s: {err.stderr}")
    log = r.stdout + r.stderr
    warnings = "\n".join(line for line in log.splitlines() if "WARNING" in line or "ERROR" in line)
    assert r.returncode == 0, (
        f"mkdocs build --strict exited {r.returncode}; fix every warning below "
        f"(bash scripts/docs.sh builds the same way):\n{warnings or log[-4000:]}"
    )
    return out


def page_text(site: Path, page: str) -> str:
    """The visible text of a built page (tags dropped, entities decoded)."""
    raw = (site / page).read_text(encoding="utf-8")
    return html.unescape(re.sub(r"<[^>]+>", " ", raw))


@pytest.mark.timeout(300)
def test_strict_build_writes_every_page(site: Path) -> None:
    for page in ("index.html", "reference/cli.html", "reference/fleet.html", "search"):
        assert (site / page).exists(), f"the build has no {page}"
    assert (site / "search" / "search_index.json").stat().st_size > 0


# ------------------------------------------------------------------ the reference vs. the code


def _reference_hook() -> Any:
    path = REPO / "scripts" / "docs_hooks" / "reference.py"
    spec = importlib.util.spec_from_file_location("docs_reference_hook", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  # its dataclasses look it up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.timeout(300)
def test_api_pages_document_every_public_name(site: Path) -> None:
    """Every name of each package's ``__all__`` (and of its public modules) is on its page, and
    the object it names is documented (its mkdocstrings heading) on the page that owns it."""
    hook = _reference_hook()
    tree = hook.SourceTree(REPO)
    pages = {page: hook.public_names(tree, package) for page, package in hook.PAGES.items()}
    chosen = hook.owners(pages)
    ids = {
        page: set(re.findall(r'id="([^"]+)"', (site / page.replace(".md", ".html")).read_text()))
        for page in pages
    }
    for page, items in pages.items():
        for item in hook.walk(items):
            assert item.name in ids[page], f"{page}: no anchor for {item.name}"
            owner = chosen[item.target][0]
            assert item.target in ids[owner], (
                f"{owner}: {item.target} (public as {item.name}) is not documented; "
                "does it have a docstring?"
            )


def _all_commands() -> dict[str, click.Command]:
    from launcher.cli import run_command
    from launcher.commands import tools

    found = {"fleetrun": run_command}
    stack = [(f"fleetrun {name}", cmd) for name, cmd in tools.commands.items()]
    while stack:
        path, cmd = stack.pop()
        found[path] = cmd
        stack += [(f"{path} {name}", sub) for name, sub in getattr(cmd, "commands", {}).items()]
    return found


@pytest.mark.timeout(300)
def test_cli_page_lists_every_subcommand_and_option(site: Path) -> None:
    """Each click command has its section on the CLI page, with every option in its table."""
    built = (site / "reference" / "cli.html").read_text(encoding="utf-8")
    for path, cmd in _all_commands().items():
        anchor = path.replace(" ", "-")
        sections = [s for s in re.split(r"(?=<h[1-6][ >])", built) if f'id="{anchor}"' in s[:200]]
        assert sections, f"reference/cli.md has no section for `{path}`"
        section = sections[0]
        ctx = click.Context(cmd, info_name=cmd.name, **cmd.context_settings)
        rows = re.findall(r"<tr>.*?</tr>", section, flags=re.DOTALL)
        for param in cmd.get_params(ctx):
            if isinstance(param, click.Option) and not param.hidden:
                for opt in (*param.opts, *param.secondary_opts):
                    assert f"<code>{html.escape(opt)}</code>" in section, (
                        f"reference/cli.md: `{path}` lacks option {opt}"
                    )
                row = next(r for r in rows if f"<td><code>{html.escape(param.opts[0])}</code>" in r)
                default = param.to_info_dict()["default"]
                shown = "<em>required</em>" if param.required else f"<code>{default}</code>"
                if param.required or default not in (None, ""):
                    assert shown in row, f"reference/cli.md: `{path}` {param.opts[0]}: not {shown}"
    assert "Sentinel.UNSET" not in built


@pytest.mark.timeout(60)
def test_every_subcommand_is_reachable_from_fleetrun() -> None:
    """``fleetrun NAME`` dispatches exactly the subcommands the CLI page documents."""
    from launcher.cli import SUBCOMMANDS
    from launcher.commands import tools

    assert set(SUBCOMMANDS) == set(tools.commands), (
        "launcher/cli.py SUBCOMMANDS and launcher.commands.tools disagree: "
        f"{sorted(set(SUBCOMMANDS) ^ set(tools.commands))}"
    )


# ------------------------------------------------------------------------------ the browser


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (a free port); the server stops at the end."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per request on stderr."""


@pytest.fixture(scope="module")
def chromium(
    tmp_path_factory: pytest.TempPathFactory, chromium_paths: dict[str, str]
) -> Iterator[Any]:
    """A headless Chromium through chromedriver (scripts/chromium.sh finds or installs both)."""
    paths = chromium_paths
    from selenium import webdriver
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    tmp = tmp_path_factory.mktemp("chromium")
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths["chromium"]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp / 'profile'}",
    ):
        opts.add_argument(arg)
    service = Service(executable_path=paths["chromedriver"], log_output=str(tmp / "driver.log"))
    driver = webdriver.Chrome(options=opts, service=service)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        try:
            driver.quit()
        except WebDriverException:
            pass
        proc = getattr(service, "process", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _wait(driver: Any, condition: Any, what: str, timeout: float = 20) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(condition)
    except TimeoutException:
        body = driver.execute_script("return document.body ? document.body.innerText : ''")
        raise AssertionError(
            f"{driver.current_url}: no {what} in {timeout} s; the page shows:\n{body[:2000]}"
        ) from None


@pytest.mark.timeout(300)
def test_front_page_and_navigation(served: str, chromium: Any) -> None:
    from selenium.webdriver.common.by import By

    chromium.get(served)
    title = _wait(chromium, lambda d: d.find_element(By.CSS_SELECTOR, "article h1"), "title")
    assert title.is_displayed() and title.text.strip(), "the front page's title is not visible"
    assert "fleetrun" in chromium.title
    links = chromium.execute_script(
        "return [...document.querySelectorAll('nav.md-nav--primary .md-nav__link')]"
        ".map((a) => a.textContent.trim())"
    )
    missing = [s for s in NAV_SECTIONS if s not in links]
    assert not missing, f"the navigation lacks {missing}; it holds {links}"


@pytest.mark.timeout(300)
def test_search_finds_distributed_embedding(served: str, chromium: Any) -> None:
    from selenium.webdriver.common.by import By

    chromium.get(served)
    # Open the search as its magnifier does (the toggle checkbox), then type into the box.
    chromium.execute_script(
        "const t = document.getElementById('__search');"
        "t.checked = true; t.dispatchEvent(new Event('change'));"
        "document.querySelector('input.md-search__input').focus();"
    )
    box = _wait(
        chromium,
        lambda d: next(
            (
                e
                for e in d.find_elements(By.CSS_SELECTOR, "input.md-search__input")
                if e.is_displayed()
            ),
            None,
        ),
        "search box",
    )
    box.send_keys("DistributedEmbedding")
    links = _wait(
        chromium,
        lambda d: [
            a
            for a in d.find_elements(By.CSS_SELECTOR, "a.md-search-result__link")
            if a.get_attribute("href")
        ],
        "search results for DistributedEmbedding",
    )
    hrefs = [a.get_attribute("href") for a in links]
    assert any(h.startswith(served) and ".html" in h for h in hrefs), hrefs
    chromium.get(hrefs[0])
    body = chromium.find_element(By.TAG_NAME, "body").text
    assert "DistributedEmbedding" in body, f"{hrefs[0]} does not mention DistributedEmbedding"


@pytest.mark.timeout(300)
def test_cli_page_shows_nproc_per_node(served: str, chromium: Any) -> None:
    from selenium.webdriver.common.by import By

    chromium.get(served + "reference/cli.html")
    found = _wait(
        chromium,
        lambda d: [e for e in d.find_elements(By.XPATH, "//td/code[text()='--nproc_per_node']")],
        "--nproc_per_node in the options table",
    )
    chromium.execute_script("arguments[0].scrollIntoView()", found[0])
    assert found[0].is_displayed()


# ------------------------------------------------------- the getting-started pages, as written


def _getting_started_commands() -> list[tuple[str, int, str]]:
    """(page, line, command) of each ``fleetrun ...`` / ``python ...`` line in a bash block."""
    found = []
    for page in sorted((REPO / "docs" / "getting-started").glob("*.md")):
        in_bash = False
        pending: tuple[int, str] | None = None
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("```"):
                in_bash = not in_bash and stripped[3:].strip() in ("bash", "sh", "shell")
                pending = None
                continue
            if not in_bash:
                continue
            if pending is not None:  # a continued line (ending with a backslash)
                start, text = pending
                text = f"{text[:-1].rstrip()} {stripped}"
                pending = (start, text) if text.endswith("\\") else None
                if pending is None:
                    found.append((page.relative_to(REPO).as_posix(), start, text))
                continue
            if stripped.startswith(("fleetrun ", "python ")):
                if stripped.endswith("\\"):
                    pending = (number, stripped)
                else:
                    found.append((page.relative_to(REPO).as_posix(), number, stripped))
    return found


COMMANDS = _getting_started_commands()


@pytest.mark.timeout(COMMAND_TIMEOUT_S + 30)
@pytest.mark.parametrize(
    ("page", "line", "command"),
    [pytest.param(*c, id=f"{c[0]}:{c[1]}") for c in COMMANDS]
    or [pytest.param(None, None, None, id="no-commands")],
)
def test_getting_started_command_runs(
    page: str | None, line: int | None, command: str | None
) -> None:
    """The command runs as written from the repository root, the venv's bin first on PATH."""
    if command is None:
        pytest.fail(
            "docs/getting-started/*.md hold no `fleetrun ...` or `python ...` line in a bash "
            "block: the getting-started pages must show commands that run"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "PADDLE_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills the job's workers too
    )
    try:
        output, _ = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{page}:{line}: `{command}` ran past {COMMAND_TIMEOUT_S} s:\n{output[-3000:]}")
    assert proc.returncode == 0, (
        f"{page}:{line}: `{command}` exited {proc.returncode}:\n{output[-3000:]}"
    )
