"""Multi-turn rollouts with tools: the agent loop. Token in, token out: the ids the engine produced are the ids
trained on, a tool's output is appended as tokens with loss mask 0, and the history is never re-tokenized from text.

    python grpo.py --task calculator                                # the built-in task that needs its tool
    python grpo.py --model-path M --train-files T --val-files V \
        --agent.tools-path my_tools.py                              # your tools (README: "Tools and multi-turn")
    python -m pytest tests/test_agent.py -q

One response is a sequence of turns. The engine generates until the model ends its turn (EOS), runs out of the response
budget, or emits the call's end (`agent.call_end`, one token: a stop token); the text from the last `agent.call_start`
up to it is the call. The tool runs (in a thread, within `agent.tool_timeout_s`), its result is written into
`agent.observation` and tokenized alone, and those tokens are appended to the response with mask 0 and no log-probs; the
next turn continues from the prompt and the whole response so far, as token ids. A call that does not parse, a tool that
raises and one that times out all return their error as the observation (counted in tool_errors) and the run goes on.

Tools are plain Python functions in a file: its list TOOLS, else every public function defined there. A call is
JSON ({"name": ..., "arguments": {...}}, Hermes / Qwen's format), a Python call with literal arguments
(`add(2, b=3)`), or, with one tool, the bare text as its one argument (`<<123*45=` for the calculator).
"""

import ast
import importlib.util
import inspect
import json
import threading
import time
from dataclasses import dataclass, field

from rollout import COUNTS, RolloutOutput, sample_seed


@dataclass
class AgentConfig:
    tools_path: str | None = None
    """A .py file of tools: its list TOOLS, else each public function defined in it (name, signature and docstring
    are the schema). None: one turn, no tools."""
    max_turns: int = 4
    """Model turns per response at most (a call made in the last one is not run)."""
    call_start: str = "<tool_call>"
    """Text that opens a tool call."""
    call_end: str = "</tool_call>"
    """Text that closes a tool call: one token of the policy's tokenizer, on which generation stops."""
    observation: str = "<tool_response>{result}</tool_response>"
    """The tool's output as appended to the response ({result} is replaced): for a chat model, the format's tool turn
    (e.g. Qwen's "<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n")."""
    tool_timeout_s: float = 10.0
    """A call that runs longer returns a timeout error as its observation (its thread is left behind)."""

    def __post_init__(self):
        if self.max_turns < 1 or self.tool_timeout_s <= 0:
            raise ValueError(f"agent.max_turns={self.max_turns} must be >= 1 and agent.tool_timeout_s="
                             f"{self.tool_timeout_s} > 0")
        if "{result}" not in self.observation:
            raise ValueError(f"agent.observation={self.observation!r} must hold {{result}}")


def load_tools(path: str) -> dict:
    """name -> function: the file's TOOLS list, else its public functions (those defined in it, not imported)."""
    spec = importlib.util.spec_from_file_location("nanoverl_tools", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fns = getattr(module, "TOOLS", None) or [f for name, f in vars(module).items() if inspect.isfunction(f)
                                              and f.__module__ == module.__name__ and not name.startswith("_")]
    if not fns:
        raise ValueError(f"agent.tools_path={path}: no tools (a TOOLS list or public functions)")
    return {f.__name__: f for f in fns}


def parse_call(text: str, tools: dict) -> tuple:
    """(function, args, kwargs) of a call's text; ValueError names what is wrong."""
    text = text.strip()
    if text.startswith("{"):  # Hermes / Qwen: {"name": ..., "arguments": {...}}
        call = json.loads(text)
        name, args, kwargs = call.get("name"), (), call.get("arguments") or {}
    else:
        try:
            node = ast.parse(text, mode="eval").body
        except SyntaxError:
            node = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in tools:
            name = node.func.id
            args = tuple(ast.literal_eval(a) for a in node.args)
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        elif len(tools) == 1:  # one tool: the bare text is its argument
            (name,), args, kwargs = tools, (text,), {}
        else:
            raise ValueError(f"cannot parse the call {text!r}: JSON or name(args) of a tool in {sorted(tools)}")
    if name not in tools:
        raise ValueError(f"no tool named {name!r} (tools: {sorted(tools)})")
    return tools[name], args, kwargs


def run_calls(calls: list, timeout_s: float) -> list[tuple[str, bool]]:
    """Each call (function, args, kwargs), or the exception that its parse raised, run at once in a thread of its
    own: (its result as text, whether it failed), within timeout_s of the start."""
    results: list = [None] * len(calls)

    def run(i, fn, args, kwargs):
        try:
            results[i] = (str(fn(*args, **kwargs)), False)
        except Exception as e:  # the tool's error is the model's observation, never the run's end
            results[i] = (f"error: {type(e).__name__}: {e}", True)

    threads = []
    for i, call in enumerate(calls):
        if isinstance(call, Exception):
            results[i] = (f"error: {call}", True)
            continue
        threads.append((i, threading.Thread(target=run, args=(i, *call), daemon=True)))
        threads[-1][1].start()
    deadline = time.monotonic() + timeout_s
    for i, thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if results[i] is None:  # still running: left behind (a thread cannot be killed)
            results[i] = (f"error: timed out after {timeout_s} s", True)
    return results


@dataclass
class Trajectory:
    """One response being built: its tokens, their log-probs and mask (1: the model's, 0: a tool's)."""
    prompt: list[int]
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    errors: int = 0

    def extend(self, tokens: list[int], log_probs: list[float], model: bool) -> None:
        self.tokens += tokens
        self.log_probs += log_probs
        self.mask += [int(model)] * len(tokens)


class AgentLoop:
    """An engine's generate, turned multi-turn: the same interface as rollout.py's engines (a RolloutOutput), with
    the response masks and each response's turns, calls and errors."""

    def __init__(self, engine, tokenizer, cfg: AgentConfig):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.tools = load_tools(cfg.tools_path)
        ids = tokenizer.encode(cfg.call_end, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"agent.call_end={cfg.call_end!r} is {len(ids)} tokens of the policy's tokenizer: it "
                             "must be one (generation stops on it)")
        self.stop_id = ids[0]

    def generate(self, prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float, top_p: float = 1.0,
                 seeds: list[int] | None = None, ignore_eos: bool = False) -> RolloutOutput:
        """n multi-turn responses per prompt (prompt-major, as the engines'). The first turn samples n per prompt with
        the prompts' seeds, as one turn would; each later turn continues every open response alone, seeded by
        (its prompt's seed, its sample, the turn), so the same seeds replay the same trajectories."""
        cfg = self.cfg
        trajs = [Trajectory(p, None if seeds is None else sample_seed(seeds[i], k, 0))
                 for i, p in enumerate(prompts) for k in range(n)]
        sampling = dict(temperature=temperature, top_p=top_p, ignore_eos=ignore_eos, stop_token_ids=[self.stop_id])
        open_ = trajs
        for turn in range(cfg.max_turns):
            if turn == 0:
                out = self.engine.generate(prompts, n=n, max_tokens=max_tokens, seeds=seeds, **sampling)
            else:
                out = self.engine.generate([t.prompt + t.tokens for t in open_], n=1,
                                           max_tokens=[max_tokens - len(t.tokens) for t in open_],
                                           seeds=None if seeds is None else [sample_seed(t.seed, 0, turn)
                                                                             for t in open_], **sampling)
            calling = []
            for t, tokens, log_probs in zip(open_, out.responses, out.log_probs):
                t.extend(tokens, log_probs, model=True)
                t.turns += 1
                if tokens and tokens[-1] == self.stop_id and len(t.tokens) < max_tokens and turn + 1 < cfg.max_turns:
                    calling.append((t, tokens))
            results = run_calls([self._parse(tokens) for _, tokens in calling], cfg.tool_timeout_s)
            for (t, _), (text, failed) in zip(calling, results):
                observation = self.tokenizer.encode(cfg.observation.format(result=text), add_special_tokens=False)
                observation = observation[: max_tokens - len(t.tokens)]  # the response budget holds both
                t.extend(observation, [0.0] * len(observation), model=False)
                t.calls, t.errors = t.calls + 1, t.errors + failed
            open_ = [t for t, _ in calling if len(t.tokens) < max_tokens]
            if not open_:
                break
        counts = dict(zip(COUNTS, ([t.turns for t in trajs], [t.calls for t in trajs], [t.errors for t in trajs])))
        return RolloutOutput([t.tokens for t in trajs], [t.log_probs for t in trajs], [t.mask for t in trajs], counts)

    def _parse(self, turn: list[int]):
        """The call a turn ends with (its text from the last call_start), or the error that says why there is none."""
        text = self.tokenizer.decode(turn)
        start = text.rfind(self.cfg.call_start)
        if start < 0:
            return ValueError(f"the call ends with {self.cfg.call_end!r} but has no {self.cfg.call_start!r}")
        try:
            return parse_call(text[start + len(self.cfg.call_start): text.rfind(self.cfg.call_end)], self.tools)
        except (ValueError, SyntaxError, json.JSONDecodeError) as e:
            return e
