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


@pytest.mark.parametrize(
    "url",
    [
        "http://[64:ff9b::a00:5]/x",  # NAT64 of 10.0.0.5
        "http://[64:ff9b::7f00:1]/x",  # NAT64 of 127.0.0.1
        "http://[2002:a00:5::]/x",  # 6to4 of 10.0.0.5
        "http://[::ffff:0:7f00:1]/x",  # SIIT IPv4-translated 127.0.0.1
        "http://[::7f00:1]/x",  # IPv4-compatible 127.0.0.1
        "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/x",  # Teredo
    ],
)
def test_ipv6_forms_that_embed_a_non_public_ipv4_address_are_refused(url):
    with pytest.raises(RefusedAddress):
        resolve(url, [])


def test_ipv6_forms_embedding_a_public_ipv4_address_pass():
    assert resolve("http://[64:ff9b::5db8:d822]/x", [])[1] == "64:ff9b::5db8:d822"  # NAT64 of 93.184.216.34


@pytest.mark.parametrize("url", ["http://localhost:99999/", "http://[::1/", "http://[fe80::1%zz]:x/", "http://a:-1/"])
def test_malformed_hosts_and_ports_are_refused_not_crashes(url):
    with pytest.raises(RefusedAddress):
        resolve(url, [])


def test_a_receiver_that_drips_its_headers_is_cut_at_the_deadline():
    """One deadline over the whole exchange: httpx's per-read timeout alone never fires here."""
    import socket
    import threading
    import time

    from core.batches.webhooks import _post
    from core.config import Settings

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    sent: list[int] = []
    stop = threading.Event()

    def drip() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n":
            if stop.is_set():
                break
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                break  # the client gave up and closed
            sent.append(byte)
            time.sleep(0.2)
        conn.close()

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    port = srv.getsockname()[1]
    settings = Settings(webhook_allow="127.0.0.1/32", webhook_timeout_s=1.0)
    try:
        with pytest.raises(TimeoutError):
            _post(f"http://127.0.0.1:{port}/hook", b"{}", {}, settings)
    finally:
        stop.set()
        t.join(5)
        srv.close()
    assert 0 < len(sent) < 100  # cut while the receiver was still dripping its headers


@pytest.mark.parametrize(
    "url",
    [
        "http://bücher.example/hook",
        "https://例え.テスト/hook",
        "http://\uff11\uff12\uff17.0.0.1/hook",  # fullwidth digits: IDNA would fold them to 127.0.0.1
        "http://example.com:\uff18\uff10/hook",
    ],
)
def test_non_ascii_hosts_are_refused_before_any_lookup(url, monkeypatch):
    """Before: a non-ASCII host went to getaddrinfo's IDNA codec and, if it resolved, on to httpx,
    whose ASCII-only headers raised outside the handled errors (an exception in every delivery)."""
    import socket

    def no_lookup(*_a, **_k):
        raise AssertionError("looked up")

    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
    with pytest.raises(RefusedAddress, match=r"punycode|not a valid URL"):
        resolve(url, [])


def test_a_punycode_host_is_an_ordinary_name():
    assert resolve("http://xn--bcher-kva.example/x", ["xn--bcher-kva.example"]) == (
        "xn--bcher-kva.example",
        "xn--bcher-kva.example",
    )


@pytest.fixture
def hung_dns(monkeypatch):
    """`slow-dns.example` does not resolve (its lookups hang until the event it yields is set, at the
    latest when the test ends); other names do."""
    import socket
    import threading

    real, release = socket.getaddrinfo, threading.Event()

    def hanging(host, *a, **k):
        if host == "slow-dns.example":
            release.wait(30)  # a resolver that does not answer
            raise socket.gaierror("no answer")
        return real(host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    try:
        yield release
    finally:
        release.set()


def test_the_dns_lookup_is_inside_the_deliverys_deadline(hung_dns):
    """Before: the lookup ran before the deadline started, on the delivery's thread: a resolver that
    hangs held it for as long as the system resolver liked. Now the attempt ends at its deadline."""
    import time

    from core.batches.webhooks import _post
    from core.config import Settings

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        _post("http://slow-dns.example/hook", b"{}", {}, Settings(webhook_timeout_s=1.0))
    assert time.monotonic() - started < 3


def test_one_tenants_hung_lookups_leave_the_dns_threads_to_the_others(hung_dns):
    """A tenant whose receivers' names never resolve holds at most DNS_PER_TENANT lookup threads (hung
    lookups cannot be interrupted); its next attempt fails at once, and another tenant's delivery
    still resolves and is sent inside its deadline."""
    import time

    from core.batches import webhooks
    from core.config import Settings

    short = Settings(webhook_timeout_s=0.3)
    try:
        for _ in range(webhooks.DNS_PER_TENANT):
            with pytest.raises(TimeoutError):
                webhooks._post("http://slow-dns.example/hook", b"{}", {}, short, tenant_id=7)
        started = time.monotonic()
        with pytest.raises(TimeoutError):  # its share is held by the hung lookups: refused without a thread
            webhooks._post("http://slow-dns.example/hook", b"{}", {}, Settings(webhook_timeout_s=5), tenant_id=7)
        assert time.monotonic() - started < 1
        assert webhooks._dns_busy[7] == webhooks.DNS_PER_TENANT
        # Another tenant's lookup runs on a free thread (the answer: a refused loopback address).
        with pytest.raises(webhooks.RefusedAddress):
            webhooks._post("http://localhost:9/hook", b"{}", {}, short, tenant_id=8)
    finally:
        hung_dns.set()
    deadline = time.monotonic() + 10
    while webhooks._dns_busy.get(7) and time.monotonic() < deadline:
        time.sleep(0.01)  # the hung lookups end once the resolver answers; then the share is free again
    assert 7 not in webhooks._dns_busy
