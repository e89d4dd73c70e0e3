"""Servers without the pathways-nb observe API (Pathways on Cloud): views fall back or say why not."""

from __future__ import annotations

import jax
import pytest

from pathways_nb.client.connection import Session
from pathways_nb.client.observe import Observer, ObserveUnavailable
from pathways_nb.core.aio_server import BackgroundServer


@pytest.fixture(scope="module")
def foreign_server():
    """A gRPC server that offers nothing of ours (only health), like a cluster that is not pathways-nb."""
    server = BackgroundServer(lambda server: None, [])
    yield f"grpc://{server.address}"
    server.stop()


def test_observer_says_the_api_is_not_offered(foreign_server):
    with pytest.raises(ObserveUnavailable, match="does not offer the pathways-nb observe API"):
        Observer(foreign_server).state()


def test_session_views_fall_back_to_jax_devices(foreign_server):
    session = Session(foreign_server, jax.devices("cpu"), "cpu", "pjrt", "someone")
    table = session.device_table()
    assert list(table["id"]) == [d.id for d in jax.devices("cpu")]
    assert set(table["island"]) == {0}
    islands = session.islands()
    assert list(islands["devices"]) == [len(jax.devices("cpu"))]
    assert "Pathways on Cloud" in session._repr_html_()
    devices = len(jax.devices("cpu"))
    row = f'<th style="text-align:left">cluster</th><td>1 island(s) x 1 host(s) x {devices} cpu device(s), pjrt, at '
    assert row + foreign_server in session._repr_html_()
    # What the table shows is text, never markup (a tenant names itself).
    named = Session(foreign_server, jax.devices("cpu"), "cpu", "pjrt", "<b>someone</b>")._repr_html_()
    assert "&lt;b&gt;someone&lt;/b&gt;" in named and "<b>someone" not in named
    with pytest.raises(ObserveUnavailable):
        session.allocations()
    with pytest.raises(ObserveUnavailable):
        session.timeline()
