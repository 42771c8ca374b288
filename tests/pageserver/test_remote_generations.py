"""Generations: the storage controller hands out one per attachment; a pageserver whose
generation is no longer current can still upload (under its own keys) but its index is never
read by a newer generation, its deletions are dropped and its remote_consistent_lsn does not
advance."""

from __future__ import annotations

import functools
import json
import urllib.request
from pathlib import Path

import trio

from common.auth import Scope
from control_plane.storage_controller import GenerationStore, StorageControllerConfig, serve
from pageserver import remote_layout
from pageserver.control_plane_client import ControlPlaneClient
from pageserver.remote_tenant import TenantRemote, find_index
from pageserver.tenant import Tenant
from protocol.ids import TenantId, TimelineId
from remote_storage import LocalStorageConfig, make_remote_storage
from tests.auth_helpers import AuthKit
from tests.pageserver.remote_helpers import FaultyStorage, check_remote_invariant
from tests.pageserver.test_compaction_concurrency import CFG, Model, check, write_l0
from tests.pageserver.test_remote_upload import workload


def _post(url: str, body: object, token: str | None = None) -> object:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def remote_for(store: object, cp: ControlPlaneClient, tenant_id: TenantId, gen: int) -> TenantRemote:
    return TenantRemote(store, gen, functools.partial(cp.validate, tenant_id, gen))  # type: ignore[arg-type]


async def test_stale_attachment_is_fenced(tmp_path: Path) -> None:
    store = FaultyStorage(make_remote_storage(LocalStorageConfig(path=tmp_path / "remote")))
    tenant_id, timeline_id = TenantId.generate(), TimelineId.generate()
    kit = AuthKit.create(tmp_path / "auth")  # with auth on, as a cluster runs it
    upcalls, admin = kit.token(Scope.GENERATIONS_API), kit.token(Scope.ADMIN)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, StorageControllerConfig(
            workdir=tmp_path / "sc", listen_http_addr="127.0.0.1:0", http_auth_type="NeonJWT",
            auth_validation_public_key_path=kit.public_path))
        url = f"http://127.0.0.1:{port}"
        cp1 = ControlPlaneClient(url + "/upcall/v1/", 1, token=upcalls)
        cp2 = ControlPlaneClient(url + "/upcall/v1/", 2, token=upcalls)
        cp3 = ControlPlaneClient(url + "/upcall/v1/", 3, token=upcalls)
        gen1 = await cp1.attach(tenant_id)
        assert gen1 == 1

        # node 1, generation 1
        model_a = Model()
        a = Tenant(tmp_path / "a", tenant_id, CFG, nursery=nursery, remote=remote_for(store, cp1, tenant_id, gen1))
        tla = await a.create_timeline(timeline_id)
        await workload(tla, model_a, rounds=1)
        assert tla.remote is not None
        await tla.remote.wait_uploaded()
        assert tla.remote_consistent_lsn == model_a.last_lsn

        # the controller moves the tenant to node 2: generation 2, loads generation 1's index
        gen2 = (await trio.to_thread.run_sync(_post, f"{url}/control/v1/tenant/{tenant_id.hex}/attach", {"node_id": 2}, admin))
        assert gen2 == {"gen": 2}
        b = await Tenant.load(tmp_path / "b", tenant_id, CFG, nursery=nursery, remote=remote_for(store, cp2, tenant_id, 2))
        tlb = b.timelines[timeline_id]
        model_b = Model()
        model_b.ops = list(model_a.ops)
        await check(tlb, model_b)

        # node 1 does not know yet: it goes on writing, compacting, collecting garbage
        stale_lsn = tla.remote_consistent_lsn
        calls_before = len(store.calls)
        await workload(tla, model_a, rounds=1)
        await tla.remote.wait_uploaded()
        stale_calls = store.calls[calls_before:]
        assert not [c for c in stale_calls if c[0] == "delete"], "a stale generation deleted objects"
        assert any(k.endswith(remote_layout.suffix(1)) and "index_part" in k for _, k in stale_calls)
        assert tla.remote_consistent_lsn == stale_lsn, "a stale generation advanced remote_consistent_lsn"
        assert tla.remote.projected_lsn > stale_lsn  # its index did go up (under its own key)

        # node 2 writes its own history
        for _ in range(2):
            await write_l0(tlb, model_b, 3)
        await tlb.compact()
        await tlb.gc()
        assert tlb.remote is not None
        await tlb.remote.wait_uploaded()
        assert tlb.remote_consistent_lsn == model_b.last_lsn

        # generation 3 (node 3) follows generation 2's index, never the stale one's later index
        assert (await trio.to_thread.run_sync(_post, f"{url}/control/v1/tenant/{tenant_id.hex}/attach", {"node_id": 3}, admin)) == {"gen": 3}
        chosen = await find_index(store, tenant_id, timeline_id, 3)
        assert chosen is not None and chosen[0] == 2
        c = await Tenant.load(tmp_path / "c", tenant_id, CFG, nursery=nursery, remote=remote_for(store, cp3, tenant_id, 3))
        await check(c.timelines[timeline_id], model_b)
        # and now node 2 is stale too: its deletions are dropped
        assert not await cp2.validate(tenant_id, 2)
        assert await cp3.validate(tenant_id, 3)
        await check_remote_invariant(store)
        for t in (a, b, c):
            await t.shutdown()
        nursery.cancel_scope.cancel()


async def test_generations_survive_a_controller_restart(tmp_path: Path) -> None:
    tenant_id = TenantId.generate().hex
    store = GenerationStore(tmp_path / "generations.json")
    assert await store.attach(tenant_id, 1, only_new=True) == 1
    assert await store.re_attach(1) == {tenant_id: 2}
    again = GenerationStore(tmp_path / "generations.json")  # a restarted controller
    assert again.valid(tenant_id, 2) and not again.valid(tenant_id, 1)
    assert await again.re_attach(1) == {tenant_id: 3}
    assert await again.re_attach(2) == {}
    assert await again.attach(tenant_id, 2) == 4
    assert await again.re_attach(1) == {}


async def test_a_deleted_tenant_keeps_a_tombstone(tmp_path: Path) -> None:
    tenant_id = TenantId.generate().hex
    store = GenerationStore(tmp_path / "generations.json")
    assert await store.attach(tenant_id, 1, only_new=True) == 1
    assert await store.forget(tenant_id)
    again = GenerationStore(tmp_path / "generations.json")  # persisted before the answer
    assert not again.valid(tenant_id, 1)  # a stale pageserver of it can neither publish nor delete
    assert await again.re_attach(1) == {}  # no pageserver gets it back at start-up
    assert await again.attach(tenant_id, 1, only_new=True) == 3  # the same id again: no reuse
    assert not await again.forget(TenantId.generate().hex)


async def test_controller_unreachable_means_not_valid(tmp_path: Path) -> None:
    from common.ports import free_port

    cp = ControlPlaneClient(f"http://127.0.0.1:{free_port()}/upcall/v1/", 1, timeout_s=1.0)
    assert not await cp.validate(TenantId.generate(), 1)
