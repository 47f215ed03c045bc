"""Whether a download can be tried is answered in seconds: offline by the environment, else by one connection."""
import socket
import time

from tread_utils.hub import hub_unavailable, unreachable


def test_offline_environment_answers_without_a_connection(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(AssertionError("dialled")))
    assert hub_unavailable() == "HF_HUB_OFFLINE=1"


def test_a_closed_port_is_a_reason_at_once(monkeypatch):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.time()
    assert "127.0.0.1 cannot be reached" in hub_unavailable()
    assert time.time() - start < 5
    assert unreachable("not a url") == "not a url names no host"


def test_a_listening_host_is_reachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert unreachable(f"http://127.0.0.1:{server.getsockname()[1]}") == ""
