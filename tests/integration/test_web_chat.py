"""The web chat page in a real browser: Debian's headless Chromium driven through chromium-driver by selenium.

`make test-integrations` installs chromium and chromium-driver when they are missing; without them
this test fails rather than skips. Screenshots go to artifacts/."""

import json
import time
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1100,760"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
MESSAGE = "Tell me about the sea."


@pytest.fixture(scope="module")
def server(serve_vault, start_server):
    return start_server(serve_vault)


@pytest.fixture
def browser(tmp_path):
    missing = [str(p) for p in (CHROMIUM, DRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: `make test-integrations` installs chromium and chromium-driver")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS + [f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    yield driver
    driver.quit()


def post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def long_reply_budget(server) -> int:
    """max_tokens for which the greedy reply to MESSAGE runs to the limit, so it is still streaming when stopped."""
    budget = min(2000, server.health["context"] - 32)  # long enough that a fast tiny model is still replying
    reply = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": MESSAGE}],
                                                  "max_tokens": budget, "temperature": 0})
    assert reply["choices"][0]["finish_reason"] == "length", "the reply ends before the limit: pick another message"
    return budget


def fill(browser, element_id: str, value) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))


def say(browser, text: str) -> None:
    fill(browser, "input", text)
    browser.find_element(By.ID, "send").click()


def replies(browser):
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def test_chat_page_streams_a_reply_stops_it_and_shows_speed_and_cache_hit_rate(server, browser):
    budget = long_reply_budget(server)
    before = server.wait_idle()["requests"]["cancelled"]
    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 60, poll_frequency=0.02)
    wait.until(lambda d: d.find_element(By.ID, "model").text)  # the page has asked /health
    fill(browser, "temperature", 0)
    fill(browser, "max-tokens", budget)
    say(browser, MESSAGE)

    lengths = set()  # the reply as it grows: more than one length means it arrived in pieces
    wait.until(lambda d: len(replies(d)) == 1)
    reply = replies(browser)[0]
    wait.until(lambda d: lengths.add(len(reply.text)) or len(lengths - {0}) >= 2)
    assert reply.get_attribute("data-done") is None, "the reply ended before it could be stopped"
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda d: reply.get_attribute("data-done") == "true")
    stopped_text = reply.text
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.note")[-1].text == "stopped"
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
    assert server.wait_idle()["requests"]["cancelled"] == before + 1
    time.sleep(0.3)
    assert reply.text == stopped_text, "text kept arriving after stop"

    wait.until(lambda d: d.find_element(By.ID, "hit-rate").text.endswith("%"))
    assert float(browser.find_element(By.ID, "tok-s").text) > 0
    assert 0 <= float(browser.find_element(By.ID, "hit-rate").text.rstrip("%")) <= 100
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "web_chat_stopped.png"))

    fill(browser, "max-tokens", 6)  # the page and the server go on after a stop
    say(browser, "And the ships?")
    wait.until(lambda d: len(replies(d)) == 2 and replies(d)[1].get_attribute("data-done") == "true")
    assert replies(browser)[1].text and browser.find_elements(By.CSS_SELECTOR, ".msg.note")[-1].text == "6 tokens"
    browser.save_screenshot(str(ARTIFACTS / "web_chat.png"))
