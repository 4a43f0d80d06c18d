"""The RL prompt loader shared by every task, in verl's parquet schema.

Each row of a task's parquet file holds:
    data_source   str                       picks the verifier ("arith", "calculator", "openai/gsm8k")
    prompt        list of {role, content}   the chat the policy completes
    ability       str                       a tag ("math")
    reward_model  {style, ground_truth}     style "rule"; ground_truth is a string
    extra_info    dict                      free-form (split, index, ...)

Make the task files, then load them:
    python -m data.arith                                       # data/arith/{train,val}.parquet
    python -m data.calculator                                  # data/calculator/{train,val}.parquet (a tool's task)
    python -m data.gsm8k --local-dir /path/to/gsm8k            # data/gsm8k/{train,test}.parquet
    python -c "from data import read_rl_parquet; print(read_rl_parquet('data/arith/val.parquet')[0])"
Test:
    python -m pytest tests/test_data.py -q
"""

import importlib.util
import math
import numbers
import os

import pyarrow as pa
import pyarrow.parquet as pq

from fileio import write_atomic

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")


def read_rl_parquet(path: str) -> list[dict]:
    """Read one parquet file in verl's RL schema into plain python rows, checking every row."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"RL parquet file not found: {path}")
    table = pq.read_table(path)
    for column in REQUIRED_COLUMNS:
        if column not in table.column_names:
            raise ValueError(f"{path}: missing required column {column!r} (columns: {table.column_names})")
    rows = table.to_pylist()  # plain lists/dicts/str: pandas would hand back numpy arrays for list columns
    for index, row in enumerate(rows):
        _check_row(row, f"{path}, row {index}")
        row["extra_info"] = row.get("extra_info") or {}
        row["ability"] = row.get("ability") or ""
    return rows


def rl_row(data_source: str, question: str, ground_truth: str, extra_info: dict) -> dict:
    """A row of verl's RL schema (above): a one-turn question, scored by rule against ground_truth."""
    return {"data_source": data_source, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": extra_info}


def write_splits(out_dir: str, splits: dict[str, list[dict]]) -> tuple[str, ...]:
    """Write each split's rows to out_dir/{split}.parquet (atomically; the folder made if missing); their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = tuple(os.path.join(out_dir, f"{split}.parquet") for split in splits)
    for path, rows in zip(paths, splits.values()):
        write_atomic(path, lambda tmp, rows=rows: pq.write_table(pa.Table.from_pylist(rows), tmp))
    return paths


def _check_row(row: dict, where: str) -> None:
    if not isinstance(row["data_source"], str):
        raise ValueError(f"{where}: field 'data_source' must be a string, got {row['data_source']!r:.200}")
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt or not all(is_message(m) for m in prompt):
        raise ValueError(f"{where}: field 'prompt' must be a non-empty list of {{'role': str, 'content': str}}, "
                         f"got {prompt!r:.200}")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or not isinstance(reward_model.get("ground_truth"), str):
        raise ValueError(f"{where}: field 'reward_model' needs a string 'ground_truth', got {reward_model!r:.200}")


def is_message(message) -> bool:
    """A chat message: {"role": str, "content": str}."""
    return isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))


def load_tokenizer(model_path: str):
    """The model folder's HF tokenizer, with a pad token: Llama-3-style tokenizers have none, and EOS stands in (as in
    TRL and verl). Every mask here comes from lengths, never from ids == pad, so a pad id that is also EOS is safe."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenize_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template the messages (ending in the assistant turn) and return plain token ids."""
    # render then encode: apply_chat_template(tokenize=True) returns a dict in some transformers versions
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template holds its special tokens


class RLDataset:
    """Tokenized prompts from one or more RL parquet files, in file order."""

    def __init__(self, files: list[str] | str, tokenizer, max_prompt_length: int, truncate: bool = False):
        files = [files] if isinstance(files, str) else list(files)
        if not files:
            raise ValueError("RLDataset: files is empty")
        if max_prompt_length < 1:
            raise ValueError(f"RLDataset: max_prompt_length must be >= 1, got {max_prompt_length}")
        self.max_prompt_length = max_prompt_length
        self.truncate = truncate
        self.num_truncated = 0
        self.items = []
        for path in files:
            for row_index, row in enumerate(read_rl_parquet(path)):
                where = f"{path}, row {row_index}"  # named by errors about this prompt (its reward)
                ids = self._fit(tokenize_prompt(tokenizer, row["prompt"]), where)
                self.items.append(dict(prompt_ids=ids, messages=row["prompt"], where=where,
                                       data_source=row["data_source"],
                                       ground_truth=row["reward_model"]["ground_truth"], extra_info=row["extra_info"]))

    def _fit(self, ids: list[int], where: str) -> list[int]:
        if len(ids) <= self.max_prompt_length:
            return ids
        if not self.truncate:
            raise ValueError(f"{where}: prompt is {len(ids)} tokens, over max_prompt_length={self.max_prompt_length} "
                             "(raise the limit, or pass truncate=True to keep the last tokens)")
        self.num_truncated += 1
        # keep the end, where the question and the generation prompt sit (verl's truncation="left")
        return ids[-self.max_prompt_length :]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {**self.items[i], "index": i}


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict | None = None) -> float:
    """Score one response with the built-in verifier for its data_source."""
    # imported here, not at the top: `python -m data.arith` imports this package first, and must not run arith twice
    from data import arith, calculator, gsm8k

    scorers = {"arith": arith.compute_score, "calculator": calculator.compute_score,
               "openai/gsm8k": gsm8k.compute_score}
    if data_source not in scorers:
        raise ValueError(f"no built-in verifier for data_source {data_source!r} (known: {sorted(scorers)}); "
                         "pass a custom reward function file instead")
    return float(scorers[data_source](solution_str, ground_truth))


def load_reward_fn(path: str | None, name: str = "compute_score"):
    """The reward function `(data_source, solution_str, ground_truth, extra_info=None) -> float`: `name` in the python
    file at `path` (verl's custom_reward_function.path / .name), or default_compute_score when path is None."""
    if path is None:
        return default_compute_score
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reward function file not found: {path}")
    spec = importlib.util.spec_from_file_location("custom_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise AttributeError(f"reward function file {path} has no function {name!r}")
    return getattr(module, name)


def score_responses(reward_fn, rows: list[dict], texts: list[str]) -> list[float]:
    """The checked reward of each response texts[b] to rows[b] (an RLDataset item); an error it raises names where."""
    scores = []
    for row, text in zip(rows, texts):
        try:
            value = reward_fn(row["data_source"], text, row["ground_truth"], row["extra_info"])
        except Exception as e:
            raise RuntimeError(f"{reward_site(reward_fn, row)} raised {type(e).__name__}: {e} (the response: "
                               f"{text!r:.200})") from e
        scores.append(checked_score(value, reward_fn, row))
    return scores


def reward_site(reward_fn, row: dict) -> str:
    """'reward function NAME (FILE) on data_source ... (prompt file, row N)': where a reward came from."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    code = getattr(reward_fn, "__code__", None)
    origin = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
    return f"reward function {name}{origin} on data_source {row['data_source']!r} ({row.get('where', 'row ?')})"


def checked_score(value, reward_fn, row: dict) -> float:
    """A reward function's answer as a float, read at "score" in a dict (as verl's may return); a non-numeric or
    non-finite value is an error naming it and where it came from (reward_site), before the run trains on it."""
    where = reward_site(reward_fn, row)
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"{where} returned a dict without a 'score' key: {value!r:.200} (return a float, "
                            "or a dict with the reward at 'score')")
        value = value["score"]
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{where} returned {value!r:.100} of type {type(value).__name__}, not a number: "
                        "return a float (e.g. 1.0 for a correct answer)")
    if not math.isfinite(value):
        raise ValueError(f"{where} returned {value}: a reward must be a finite number")
    return float(value)
