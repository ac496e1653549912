"""The engine core over a verifier replica (orchestrator/remote_loop.py), the replica's gRPC server in this
process so its calls can be counted: a step is one VerifyBatch call, and a replica that predates VerifyBatch
(it answers UNIMPLEMENTED) gets one Verify per request from then on. Both give the AR greedy output, batched.
(The same core through real processes: test_grpc_services.py, test_tracing.py.)
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import grpc
import pytest
from spec_helpers import greedy
from test_engine_core import MAX_NEW, PROMPTS, method_of, run_all

from orchestrator.core import EngineCore
from specmesh import rpc
from specmesh.v1 import verifier_pb2_grpc
from verifier_service.remote import VerifierClient
from verifier_service.server import VerifierServicer
from verifier_service.step_loop import StepLoop
from verifier_service.verifier import LocalVerifier


class CountingReplica(VerifierServicer):
    """A verifier replica that counts the calls it answers."""

    def __init__(self, loop: StepLoop) -> None:
        super().__init__(loop)
        self.calls: Counter[str] = Counter()

    async def Verify(self, request, context):
        self.calls["Verify"] += 1
        return await super().Verify(request, context)

    async def VerifyBatch(self, request, context):
        self.calls["VerifyBatch"] += 1
        self.calls["items"] += len(request.items)
        return await super().VerifyBatch(request, context)


class OlderReplica(CountingReplica):
    """A replica built before VerifyBatch existed: grpc's answer for a method a servicer lacks."""

    async def VerifyBatch(self, request, context):
        self.calls["VerifyBatch"] += 1
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")


class ServerThread:
    """A grpc.aio server for ``servicer`` on 127.0.0.1, run by an event loop on a thread of its own."""

    def __init__(self, servicer: VerifierServicer) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server()
            verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        self.server, port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout=30)
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.mark.parametrize("replica", [CountingReplica, OlderReplica])
@pytest.mark.parametrize("proposer", [None, "prompt_lookup_tree"])
def test_remote_core_steps_in_one_call_and_equals_ar(model_sets, ar_reference, replica, proposer):
    runner = model_sets("cyclic").runner("target", "fast")
    step_loop = StepLoop(LocalVerifier(runner))
    servicer = replica(step_loop)
    server = ServerThread(servicer)
    client = VerifierClient(server.address, rpc.Security(), call_timeout=30)
    core = None
    try:
        client.fetch_info(timeout=30)
        core = EngineCore(client)
        method, _, _ = method_of(proposer)
        outputs = run_all(core, method, PROMPTS, greedy(MAX_NEW))
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.tokens == ar_reference("cyclic", "fast", prompt, MAX_NEW), proposer
        assert step_loop.stats.max_batch > 1, "no two requests were ever verified in one forward"
        request_steps = sum(len(o.result.stats.steps) for o in outputs)
        assert core.stats.verified == request_steps
        if replica is CountingReplica:  # one call per step, carrying every running request's tree
            assert servicer.calls["Verify"] == 0 and servicer.calls["VerifyBatch"] == core.stats.steps
            assert servicer.calls["items"] == request_steps
        else:  # asked once, then one Verify per request and step
            assert servicer.calls["VerifyBatch"] == 1
            assert servicer.calls["Verify"] == request_steps
    finally:
        if core is not None:
            core.close()
        client.close()
        server.stop()
        step_loop.close()
