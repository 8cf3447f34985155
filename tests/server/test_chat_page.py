"""The chat page at / in headless Chromium (Selenium + Debian's chromium/chromium-driver):
a typed message gets a streamed answer from the chat endpoint."""
from __future__ import annotations

import shutil
import time

import pytest


def _browser_binary() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             shutil.which("google-chrome")) if p), None)


@pytest.fixture(scope="module")
def driver():
    webdriver = pytest.importorskip("selenium.webdriver")
    browser, chromedriver = _browser_binary(), shutil.which("chromedriver")
    if browser is None or chromedriver is None:
        pytest.skip("chromium and chromedriver are not installed "
                    "(apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    opts = Options()
    opts.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1000,800"):
        opts.add_argument(flag)
    d = webdriver.Chrome(service=Service(chromedriver), options=opts)
    yield d
    d.quit()


def test_chat_page_streams_an_answer(default_server, driver, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    driver.get(default_server.url + "/")
    assert driver.title == "slipstream chat"
    WebDriverWait(driver, 20).until(
        lambda d: d.find_element(By.ID, "model").text.startswith("SmolLM2"))
    # Count the text the page shows while the answer streams: it must grow in steps.
    driver.execute_script("""
        window.__lengths = [];
        new MutationObserver(() => {
          const a = document.querySelector('.assistant');
          if (a) window.__lengths.push(a.textContent.length);
        }).observe(document.getElementById('log'), {subtree: true, childList: true,
                                                    characterData: true});""")
    driver.find_element(By.ID, "max-tokens").clear()
    driver.find_element(By.ID, "max-tokens").send_keys("24")
    driver.find_element(By.ID, "temperature").clear()
    driver.find_element(By.ID, "temperature").send_keys("0")
    box = driver.find_element(By.ID, "input")
    box.send_keys("What is the capital of France?")
    driver.find_element(By.ID, "send").click()
    WebDriverWait(driver, 60).until(
        lambda d: d.find_element(By.CSS_SELECTOR, ".msg:last-child").get_attribute("data-state")
        in ("done", "error"))
    answer = driver.find_element(By.CSS_SELECTOR, ".assistant")
    assert answer.get_attribute("data-state") == "done", answer.text
    assert "Paris" in answer.text
    assert driver.find_element(By.CSS_SELECTOR, ".user").text == "What is the capital of France?"
    lengths = driver.execute_script("return window.__lengths")
    assert len({n for n in lengths if n > 0}) >= 3, lengths   # streamed, not one block
    driver.save_screenshot(str(tmp_path / "chat.png"))
    # A second turn carries the history.
    box.send_keys("Thanks!")
    driver.find_element(By.ID, "send").click()
    time.sleep(0.2)
    WebDriverWait(driver, 60).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 2 and
        d.find_elements(By.CSS_SELECTOR, ".assistant")[1].get_attribute("data-state") == "done")
