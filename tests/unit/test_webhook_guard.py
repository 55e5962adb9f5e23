"""The webhook address guard and signatures (pure: literal addresses need no DNS)."""

from __future__ import annotations

import pytest

from core.batches.webhooks import RefusedAddress, new_secret, resolve, sign, verify


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x",
        "http://127.9.9.9:8000/x",
        "http://10.0.0.5/x",
        "http://172.16.3.4/x",
        "http://192.168.1.1/x",
        "http://169.254.169.254/latest/meta-data/",  # AWS/GCP/Azure metadata
        "http://100.64.0.1/x",  # carrier-grade NAT
        "http://0.0.0.0/x",
        "http://[::1]/x",
        "http://[fd00:ec2::254]/x",  # AWS metadata over IPv6 (unique local)
        "http://[fe80::1]/x",
        "http://224.0.0.1/x",  # multicast
        "http://[::ffff:127.0.0.1]/x",  # v4-mapped loopback
        "https://user:pw@93.184.216.34/x",
        "file:///etc/passwd",
        "gopher://93.184.216.34/x",
    ],
)
def test_non_public_addresses_and_odd_urls_are_refused(url):
    with pytest.raises(RefusedAddress):
        resolve(url, [])


def test_public_literal_addresses_pass_and_are_the_ones_connected_to():
    assert resolve("https://93.184.216.34/hook", []) == ("93.184.216.34", "93.184.216.34")
    assert resolve("http://[2606:4700::1111]/hook", []) == ("2606:4700::1111", "2606:4700::1111")


def test_an_operator_allowlist_opens_exactly_what_it_names():
    assert resolve("http://10.0.0.5/x", ["10.0.0.0/8"])[1] == "10.0.0.5"
    assert resolve("http://127.0.0.1:9/x", ["127.0.0.1/32"])[1] == "127.0.0.1"
    with pytest.raises(RefusedAddress):
        resolve("http://127.0.0.2/x", ["127.0.0.1/32"])
    with pytest.raises(RefusedAddress):
        resolve("http://169.254.169.254/x", ["10.0.0.0/8", "not-a-network"])


def test_signatures_verify_with_their_secret_only():
    a, b = new_secret(), new_secret()
    body = b'{"type": "batch.completed"}'
    headers = sign(a, "msg_1", body)
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    assert verify(a, body, headers)
    assert not verify(b, body, headers)
    assert not verify(a, body + b" ", headers)
