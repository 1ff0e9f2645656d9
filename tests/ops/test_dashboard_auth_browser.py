"""The dashboard with --auth in real headless Chromium: sign-in, then users and policies
managed by a Super user, and a disabled user's device disconnected."""

from __future__ import annotations

from pathlib import Path

from tests.mqtt.paho_client import Client
from tests.ops.browser import browser_page, needs_chromium
from tests.security.helpers import ADMIN, add_user, auth_server

pytestmark = needs_chromium


def test_sign_in_and_manage_users_and_policies(tmp_path: Path) -> None:
    srv = auth_server(tmp_path)
    add_user(srv, "device7", "d7-pw")
    device = Client(srv.port, "device7", version=5, username="device7", password="d7-pw")
    try:
        with browser_page(1280, 1400) as page:
            page.goto(f"http://{srv.addrs['http']}/")
            page.wait_for_selector("#login:not([hidden])", timeout=10_000)
            page.fill("#login-user", "admin")
            page.fill("#login-pass", "wrong")
            page.click("#login-form button")
            page.wait_for_function(
                "document.getElementById('login-error').textContent.length > 0")
            page.fill("#login-pass", ADMIN[1])
            page.click("#login-form button")
            page.wait_for_selector("#login", state="hidden", timeout=10_000)
            page.wait_for_function("document.getElementById('whoami').textContent"
                                   ".includes('admin')")
            page.wait_for_selector("tr[data-user='device7']", timeout=10_000)
            # add a user and a policy through the forms
            page.fill("#new-user", "ops")
            page.fill("#new-pass", "ops-pw")
            page.click("#user-form button")
            page.wait_for_selector("tr[data-user='ops']", timeout=10_000)
            page.fill("#acl-user", "device7")
            page.fill("#acl-resource", "Topic:plant/")
            page.select_option("#acl-match", "prefixed")
            page.fill("#acl-actions", "PUB,SUB")
            page.click("#acl-form button")
            page.wait_for_selector("tr[data-policy='device7 Topic:plant/']",
                                   timeout=10_000)
            assert device.pub_codes[device.publish("plant/a", b"1", qos=1)] == 0
            # a bad policy shows the server's reason
            page.fill("#acl-resource", "Queue:x")
            page.click("#acl-form button")
            page.wait_for_function(
                "document.getElementById('admin-error').textContent.includes('resource')")
            page.screenshot(path=str(tmp_path / "dashboard-admin.png"), full_page=True)
            # disabling the device's user ends its session
            page.click("tr[data-user='device7'] button.toggle-user")
            assert device.disconnected.wait(10)
            page.wait_for_function("document.querySelector(\"tr[data-user='device7']\")"
                                   ".textContent.includes('disabled')")
            page.click("#logout")
            page.wait_for_selector("#login:not([hidden])", timeout=10_000)
        assert (tmp_path / "dashboard-admin.png").stat().st_size > 10_000
    finally:
        device.drop()
        assert srv.stop() == 0
