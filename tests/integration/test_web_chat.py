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


def greedy_reply(server, messages: list[dict], max_tokens: int) -> str:
    return post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                 "temperature": 0})["choices"][0]["message"]["content"]


def test_system_prompt_is_sent_and_new_chat_starts_over(server, browser):
    system = "You are a pirate. Answer every question about ships."
    with_system = greedy_reply(server, [{"role": "system", "content": system}, {"role": "user", "content": MESSAGE}], 8)
    without = greedy_reply(server, [{"role": "user", "content": MESSAGE}], 8)
    assert with_system != without, "the system prompt does not change the reply: pick another one"
    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 60, poll_frequency=0.02)
    wait.until(lambda d: d.find_element(By.ID, "model").text)
    fill(browser, "temperature", 0)
    fill(browser, "max-tokens", 8)
    fill(browser, "system", system)
    say(browser, MESSAGE)
    wait.until(lambda d: len(replies(d)) == 1 and replies(d)[0].get_attribute("data-done") == "true")
    assert replies(browser)[0].text.strip() == with_system.strip()

    browser.find_element(By.ID, "new-chat").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
    browser.find_element(By.ID, "system").clear()
    say(browser, MESSAGE)  # were the first exchange still in the conversation, the reply would follow it
    wait.until(lambda d: len(replies(d)) == 1 and replies(d)[0].get_attribute("data-done") == "true")
    assert replies(browser)[0].text.strip() == without.strip()
    assert [m.text for m in browser.find_elements(By.CSS_SELECTOR, ".msg.user")] == [MESSAGE]
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "web_chat_new_chat.png"))


def test_the_page_asks_for_the_key_of_a_server_with_one_and_chats_once_given_it(serve_vault, start_server, browser):
    server = start_server(serve_vault, "--api-key", "page-key")
    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 60, poll_frequency=0.02)
    wait.until(lambda d: d.find_element(By.ID, "model").text)
    assert browser.find_element(By.ID, "key-field").is_displayed()
    fill(browser, "max-tokens", 4)
    say(browser, MESSAGE)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.error"))
    assert "API key" in browser.find_element(By.CSS_SELECTOR, ".msg.error").text
    fill(browser, "api-key", "page-key")
    say(browser, MESSAGE)
    wait.until(lambda d: len(replies(d)) == 2 and replies(d)[1].get_attribute("data-done") == "true")
    assert replies(browser)[1].text and browser.find_elements(By.CSS_SELECTOR, ".msg.note")[-1].text == "4 tokens"


def test_the_key_field_stays_hidden_on_a_server_without_a_key(server, browser):
    browser.get(server.url + "/")
    WebDriverWait(browser, 60, poll_frequency=0.02).until(lambda d: d.find_element(By.ID, "model").text)
    assert not browser.find_element(By.ID, "key-field").is_displayed()
