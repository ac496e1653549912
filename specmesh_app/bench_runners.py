"""What `specmesh bench` runs and how it measures: specmesh engines, HF peers, forward counting."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

from specmesh.sampling import SamplingParams

HF_METHODS = ("hf_ar", "hf_assisted", "hf_prompt_lookup")
GRPC_PREFIX = "grpc:"


@dataclass(frozen=True)
class MethodSpec:
    """A method of the benchmark, parsed (``bench.parse_method``)."""

    label: str  # as typed; unique within a run
    name: str  # ar, a proposer name, or one of HF_METHODS
    options: tuple[tuple[str, object], ...] = ()

    @property
    def is_hf(self) -> bool:
        return self.name in HF_METHODS

    @property
    def is_grpc(self) -> bool:
        return self.name.startswith(GRPC_PREFIX)

    @property
    def base_name(self) -> str:
        """The method without its ``grpc:`` prefix."""
        return self.name.removeprefix(GRPC_PREFIX)

    @property
    def acceptance(self) -> str:
        """How the verifier accepts the method's drafts: "exact", or a lossy one ("mjsd") for the proposer that
        asks for it (``orchestrator.acceptance``)."""
        from orchestrator.acceptance import acceptance_of

        return "exact" if self.is_hf else acceptance_of(self.base_name)

    @property
    def lossy(self) -> bool:
        return self.acceptance != "exact"


def asked_sampling(spec: MethodSpec, sampling: SamplingParams) -> SamplingParams:
    """The sampling the method's requests carry: the acceptance of its proposer, with its ``threshold`` option
    (mjsd). ValueError for a lossy method with temperature > 0, a threshold given to any other method, or logit
    processors (penalties, logit_bias) for a Hugging Face peer (they would not decode the same distribution)."""
    from orchestrator.acceptance import request_sampling
    from specmesh.logits_process import processes_logits

    if spec.is_hf:
        if processes_logits(sampling) or sampling.logprobs is not None:
            raise ValueError(f"{spec.label}: the Hugging Face peers run without penalties, logit_bias and logprobs; "
                             "leave them out of --methods")
        return sampling
    name = None if spec.base_name == "ar" else spec.base_name
    return request_sampling(name, sampling, dict(spec.options).get("threshold"))


# keys of hf_assisted that transformers reads from the draft model's generation config
ASSISTANT_CONFIG_KEYS = {"num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"}


class ForwardMeter:
    """Counts a model's forward passes and the time spent in them, whichever path runs them.

    specmesh calls ``runner.forward`` / ``forward_batch`` (the fast runner never enters the HF module), HF
    ``generate`` calls the module: both are wrapped, and a call nested in another
    (the HF runner's forward calling the module) counts once.
    """

    def __init__(self, runner) -> None:
        self.calls, self.seconds = 0, 0.0
        self._depth, self._t0 = 0, 0.0
        self._runner, self._handles = runner, []
        if runner is None:
            return
        for name in ("forward", "forward_batch"):  # instance attributes shadow the methods until close()
            setattr(runner, name, self._counted(getattr(runner, name)))
        if runner.model is not None:  # a runner read from the checkpoint has no module (HF peers need one)
            self._handles = [
                runner.model.register_forward_pre_hook(lambda *_: self._enter()),
                runner.model.register_forward_hook(lambda *_: self._exit(), always_call=True),
            ]

    def _counted(self, fn):
        def counted(*args, **kwargs):
            self._enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit()

        return counted

    def _enter(self) -> None:
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0
            self.calls += 1

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self._handles:
            del self._runner.forward, self._runner.forward_batch


@dataclass
class RunOutput:
    token_ids: list[int]  # generated tokens, a final EOS included
    seconds: float
    target_forwards: int = 0
    target_forward_seconds: float = 0.0
    draft_forwards: int = 0
    draft_forward_seconds: float = 0.0
    stats: object | None = None  # RequestStats for specmesh methods


class SpecmeshRunner:
    """A method one request at a time, on the stack's engine core (what every command runs), with a proposer of
    its own (it learns nothing from other methods' runs)."""

    def __init__(self, stack, spec: MethodSpec) -> None:
        options = {k: v for k, v in spec.options if k != "threshold"}  # the verifier's (mjsd), not the proposer's
        self.spec = spec
        self.engine = stack.engine(None if spec.name == "ar" else spec.name, fresh=True, **options)

    def run(self, prompt: list[int], sampling: SamplingParams) -> RunOutput:
        sampling = asked_sampling(self.spec, sampling)
        t0 = time.perf_counter()
        result = self.engine.generate(prompt, sampling)
        return RunOutput(result.token_ids, time.perf_counter() - t0, stats=result.stats)


class HFRunner:
    """``generate`` on the target model; EOS and max_new_tokens stop it exactly as they stop specmesh."""

    def __init__(self, stack, spec: MethodSpec) -> None:
        self.target = stack.target_runner.model
        self.eos = list(stack.target_runner.info.eos_token_ids)
        pad = getattr(stack.tokenizer, "pad_token_id", None)
        self.kwargs: dict = {"eos_token_id": self.eos or None, "pad_token_id": pad if pad is not None else (self.eos or [0])[0]}
        self.draft_config = None
        options = dict(spec.options)
        if spec.name == "hf_assisted":
            draft = stack.draft_runner.model
            self.kwargs["assistant_model"] = draft
            self.draft_config = copy.deepcopy(draft.generation_config)
            for key in ASSISTANT_CONFIG_KEYS & options.keys():
                setattr(self.draft_config, key, options.pop(key))
        self.kwargs.update(options)

    def run(self, prompt: list[int], sampling: SamplingParams) -> RunOutput:
        import torch

        ids = torch.tensor([prompt], dtype=torch.long, device=self.target.device)
        kwargs = dict(self.kwargs, max_new_tokens=sampling.max_new_tokens, attention_mask=torch.ones_like(ids))
        if sampling.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
            if sampling.seed is not None:  # HF generate samples from torch's global RNG
                torch.manual_seed(sampling.seed)
        draft = kwargs.get("assistant_model")
        saved = draft.generation_config if draft is not None else None
        if draft is not None:  # transformers reads the draft budget from the draft's own generation config
            draft.generation_config = copy.deepcopy(self.draft_config)
        try:
            t0 = time.perf_counter()
            tokens = self.target.generate(ids, **kwargs)[0, len(prompt) :].tolist()  # on the host: synced
            seconds = time.perf_counter() - t0
        finally:
            if draft is not None:
                draft.generation_config = saved
        for i, tok in enumerate(tokens):  # cut padding after EOS
            if tok in self.eos:
                tokens = tokens[: i + 1]
                break
        return RunOutput(tokens, seconds)


class GrpcRunner:
    """The method through the client SDK and a running `specmesh serve` (``grpc:NAME``).

    Statistics come from the streamed per-step stats; target forwards are one per step
    plus the prefill, exactly, since that is how the verifier works."""

    remote = True

    def __init__(self, client, spec: MethodSpec) -> None:
        self.client = client
        self.params: dict = {"proposer": spec.base_name if spec.base_name != "ar" else "none"}
        options = dict(spec.options)
        if "max_nodes" in options:
            self.params.update(max_nodes=options.pop("max_nodes"), max_depth=options.pop("max_depth"))
        for key in ("overlap", "policy", "restart_depth"):
            if key in options:
                self.params[key] = options.pop(key)
        if "threshold" in options:  # mjsd: the request's (the server sets the acceptance from the proposer)
            self.params["mjsd_threshold"] = options.pop("threshold")
        if options:
            raise ValueError(f"{spec.label}: only max_nodes, max_depth, overlap, policy, restart_depth and (mjsd) "
                             "threshold can be set for grpc: methods")
        self.acceptance = spec.acceptance

    def run(self, prompt: list[int], sampling: SamplingParams) -> RunOutput:
        from orchestrator.stats import RequestStats, StepStats

        stats = RequestStats(prompt_tokens=len(prompt), acceptance=self.acceptance)
        tokens: list[int] = []
        t0 = time.perf_counter()
        for chunk in self.client.stream(
            prompt, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, seed=sampling.seed, stop=sampling.stop, stop_token_ids=sampling.stop_token_ids,
            ignore_eos=sampling.ignore_eos, **self.params,
        ):
            tokens += chunk.token_ids
            if chunk.step is not None:
                s = chunk.step
                proposed = tuple(name for name, count in s.proposed_per_source for _ in range(count))
                stats.steps.append(StepStats(s.num_proposed, s.tree_depth, s.num_accepted, s.accepted_sources,
                                             proposed, s.draft_ms / 1e3, s.verify_ms / 1e3, s.draft_error, s.budget,
                                             wait_seconds=s.wait_ms / 1e3, predrafted=s.predrafted,
                                             step_seconds=s.step_ms / 1e3, drafter_busy_seconds=s.drafter_busy_ms / 1e3,
                                             predraft_nodes=s.predraft_nodes, predraft_used=s.predraft_used))
        seconds = time.perf_counter() - t0
        stats.total_seconds, stats.num_generated = seconds, len(tokens)
        return RunOutput(tokens, seconds, target_forwards=stats.num_steps + 1, stats=stats)


def method_runner(stack, spec: MethodSpec, client=None):
    if spec.is_grpc:
        return GrpcRunner(client, spec)
    return HFRunner(stack, spec) if spec.is_hf else SpecmeshRunner(stack, spec)


def measured_run(runner, prompt: list[int], sampling: SamplingParams, target: ForwardMeter, draft: ForwardMeter) -> RunOutput:
    """One run with the forward counts and times it caused."""
    t_calls, t_sec, d_calls, d_sec = target.calls, target.seconds, draft.calls, draft.seconds
    out = runner.run(prompt, sampling)
    if getattr(runner, "remote", False):  # its forwards ran in other processes
        return out
    out.target_forwards, out.target_forward_seconds = target.calls - t_calls, target.seconds - t_sec
    out.draft_forwards, out.draft_forward_seconds = draft.calls - d_calls, draft.seconds - d_sec
    return out


# ----------------------------------------------------------------- the benchmark
