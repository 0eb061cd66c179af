"""Perplexity of a model on a prepared dataset's held-out split: `pylon.evaluate(...)`, `pylon eval`.

    result = pylon.evaluate("./model")                                   # an export: its eval.json names the data
    result = pylon.evaluate("http://127.0.0.1:8000", data="s3://bucket/ds/", validation_fraction=0.05)
    print(result.loss, result.perplexity, result.tokens)

The held-out split is the trainer's (`pylon.data.reader.split_ids`: the tail of the dataset's id space), read here
straight from the shards (sizes and sha256 checked against the manifest), without Ray. The loss is the trainer's
(`pylon.jobs.train.token_loss_sum`): next-token cross-entropy summed over every non-padding token that has a
predecessor in its row (a row of n tokens scores n - 1), divided by their count over the whole split, in fp32.

- An export directory (local, or s3:// copied to a temporary directory): `transformers` in fp32 on the GPU if
  there is one, else the CPU, on the rows exactly as the trainer batches them (padding masked).
- A deployment (`http(s)://HOST:PORT[/prefix]`): each row's non-padding token ids are a token-id prompt to
  `POST /v1/completions` with `echo: true, logprobs: 0, max_tokens: 0`; the prompt tokens' log-probabilities
  (`choices[0].logprobs.token_logprobs`, the first null) give the same sum: -sum(logprobs[1:]) over n - 1
  tokens. A bounded number of requests is in flight at once.

Rows packed from several documents are attended as the training run attended them (`attention_mask`, recorded in
the export's eval.json): under "document" each document is scored on its own (restarting positions for a model; its
own prompt for a deployment) and its first token is not scored, which is the trainer's arithmetic.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pylon.errors import PylonError

if TYPE_CHECKING:  # numpy, storage and the rest load on use: `pylon --help` imports this module
    import numpy as np

DEFAULT_API_KEY_ENV = "PYLON_API_KEYS"  # the example deployment's http.api_keys_env: its first key is used
DEFAULT_CONCURRENCY = 8
METRIC = "mean next-token cross-entropy (nats/token) over the held-out split; perplexity = exp(loss)"


@dataclass
class HeldOut:
    """The held-out rows of a prepared dataset: each row's non-padding token ids, in id order."""

    dataset: str
    validation_fraction: float
    ids: tuple[int, int]  # the split's sample ids [lo, hi)
    sequences: list[np.ndarray]
    seq_len: int
    pad_id: int
    tokenizer: dict
    # a chat dataset's rows (ShardManifest.loss_mask): tokens outside the assistant's replies stored as -(id + 1),
    # scored as context only
    loss_mask: bool = False
    eos_id: int = -1  # a text dataset's document end
    # each document of a row scored on its own, as the trainer attends it under `attention_mask: document`
    documents: bool = False
    # a preference dataset's pairs (ShardManifest.preference, preference_format): what a reward model is scored on
    preference: bool = False
    preference_format: str | None = None

    def token_ids(self, seq: np.ndarray) -> np.ndarray:
        """A row's token ids (a chat dataset's context tokens decoded)."""
        from pylon.data.shards import split_words

        return split_words(seq, loss_mask=self.loss_mask, eos_id=self.eos_id)[0]

    def counted(self, seq: np.ndarray) -> np.ndarray | None:
        """Which of a row's tokens the loss counts (a chat dataset's: the assistant's replies); None: all."""
        from pylon.data.shards import split_words

        context = split_words(seq, loss_mask=self.loss_mask, eos_id=self.eos_id)[1]
        return None if context is None else ~context

    def batches(self, batch_size: int, device=None):
        """The rows batched as the trainer batches them (full rows, padding masked; each document on its own under
        `documents`), `batch_size` at a time: (rows in the batch, `Batch.to_torch`'s inputs on `device`)."""
        import numpy as np

        from pylon.data.reader import Batch

        for start in range(0, len(self.sequences), batch_size):
            chunk = self.sequences[start : start + batch_size]
            rows = np.full((len(chunk), self.seq_len), self.pad_id, dtype=np.int64)
            for r, seq in enumerate(chunk):
                rows[r, : len(seq)] = seq
            lengths = np.array([len(q) for q in chunk], dtype=np.int32)
            batch = Batch(np.arange(len(chunk)), rows, lengths, 0.0, self.loss_mask, self.eos_id)
            yield len(chunk), batch.to_torch(self.pad_id, device=device, documents=self.documents)

    def pieces(self, seq: np.ndarray) -> list[tuple[int, int]]:
        """The spans [lo, hi) of a row scored apart: its documents under `documents`, else the whole row."""
        import numpy as np

        if not self.documents:
            return [(0, len(seq))]
        from pylon.data.shards import split_words

        starts = np.flatnonzero(split_words(seq, loss_mask=self.loss_mask, eos_id=self.eos_id)[2]).tolist()
        bounds = [0, *starts, len(seq)]
        return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


@dataclass
class Evaluation:
    """What `evaluate` measured. `as_dict()` is `pylon eval --json`'s object (docs/eval.md lists its keys)."""

    loss: float
    perplexity: float | None  # None: a reward model's (its loss is the pairs' Bradley-Terry loss)
    tokens: int
    sequences: int
    source: str  # "model" (an export directory, transformers) or "endpoint" (a deployment over HTTP)
    model: str  # the export directory or the endpoint's base URL
    served_model: str | None  # the deployment's model name (endpoint only)
    device: str | None  # where transformers ran (model only)
    dataset: str
    split: str
    validation_fraction: float
    ids: list[int]  # the split's sample ids [lo, hi); `sequences` of them were scored, from lo on
    seconds: float
    recorded: dict | None  # the export's eval.json (the trainer's own figure), when it has one
    attention_mask: str = "causal"  # how packed rows were attended: "causal", or "document" (each on its own)
    metric: str = METRIC
    # a reward model's: the held-out preference pairs scored, and their figures (as the trainer's val_reward_*):
    # reward_accuracy, reward_margin, reward_chosen, reward_rejected
    pairs: int | None = None
    rewards: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------
# The loss: one arithmetic for both paths
# ---------------------------------------------------------------------------------------------------------


def prompt_loss_sum(
    token_logprobs: Sequence[float | None], n_tokens: int, counted: Sequence[bool] | None = None
) -> tuple[float, int]:
    """A scored prompt of `n_tokens` tokens as (summed next-token loss, tokens counted), the trainer's way:
    position t predicts token t+1, so the first token (logprob null) counts for nothing and n - 1 tokens do
    (`counted`: only the tokens it marks, a chat dataset's assistant replies)."""
    if len(token_logprobs) != n_tokens:
        raise PylonError(
            f"the server scored {len(token_logprobs)} prompt tokens of {n_tokens} sent; it must echo the prompt "
            "token for token (a token-id prompt with echo: true, logprobs: 0, max_tokens: 0)"
        )
    if n_tokens == 0:
        return 0.0, 0
    if token_logprobs[0] is not None:
        raise PylonError("the server gave the first prompt token a logprob; OpenAI's shape (and Pylon's) has null")
    rest = token_logprobs[1:]
    if any(lp is None for lp in rest):
        raise PylonError("the server left a prompt token after the first without a logprob")
    if counted is not None:
        rest = [lp for lp, c in zip(rest, counted[1:]) if c]
    return -math.fsum(float(lp) for lp in rest), len(rest)


def reduce_losses(parts: Sequence[tuple[float, int]]) -> tuple[float, int]:
    """Summed losses and token counts of many sequences as (mean loss per token, tokens): every token weighs the
    same, whichever sequence holds it, as in the trainer's evaluation."""
    total = math.fsum(s for s, _ in parts)
    tokens = sum(n for _, n in parts)
    if tokens == 0:
        raise PylonError("nothing to score: the held-out sequences have no token with a predecessor")
    return total / tokens, tokens


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else float("inf")


# ---------------------------------------------------------------------------------------------------------
# The data
# ---------------------------------------------------------------------------------------------------------


def held_out(
    dataset: str, validation_fraction: float, max_sequences: int | None = None, *, attention_mask: str = "auto"
) -> HeldOut:
    """The held-out split the trainer evaluates on (`data.validation_fraction` of the same dataset), its first
    `max_sequences` rows when given, read from the shards without Ray; attended as `attention_mask` says (the
    TrainJob field's values: auto, causal, document)."""
    import numpy as np

    from pylon import storage
    from pylon.data.reader import split_ids
    from pylon.data.shards import decode_shard, read_manifest, separate_documents, verify_shard_bytes

    if not 0 < validation_fraction < 1:
        raise PylonError(
            f"validation fraction {validation_fraction}: must be in (0, 1), the training run's "
            "data.validation_fraction (0 has no held-out split)"
        )
    if max_sequences is not None and max_sequences < 1:
        raise PylonError(f"max sequences {max_sequences}: must be at least 1")
    if attention_mask not in ("auto", "causal", "document"):
        raise PylonError(f"attention mask {attention_mask!r}: must be auto, causal or document")
    manifest = read_manifest(dataset)
    documents = separate_documents(attention_mask, manifest, dataset)
    lo, hi = split_ids(manifest, validation_fraction)["validation"]
    if lo == hi:
        raise PylonError(
            f"{dataset}: the held-out split is empty ({manifest.totals.rows} rows, validation fraction "
            f"{validation_fraction})"
        )
    end = hi if max_sequences is None else min(hi, lo + max_sequences)
    sequences: list[np.ndarray] = []
    for info in manifest.shards:
        a, b = max(lo, info.first_id), min(end, info.first_id + info.rows)
        if a >= b:
            continue
        uri = storage.join(dataset, info.file)
        data = storage.read_bytes(uri)  # retried as every storage read is
        verify_shard_bytes(info, data)
        rows = decode_shard(manifest.format, data, shard=info.file, seq_len=manifest.seq_len, dtype=manifest.dtype)
        for i in np.flatnonzero((rows.ids >= a) & (rows.ids < b)):
            sequences.append(np.asarray(rows.tokens[i, : int(rows.num_tokens[i])], dtype=np.int64))
    if len(sequences) != end - lo:
        raise PylonError(f"{dataset}: found {len(sequences)} of the {end - lo} held-out rows [{lo}, {end})")
    return HeldOut(
        dataset=dataset,
        validation_fraction=validation_fraction,
        ids=(lo, hi),
        sequences=sequences,
        seq_len=manifest.seq_len,
        pad_id=manifest.tokenizer.pad_id,
        tokenizer=manifest.tokenizer.model_dump(mode="json"),
        loss_mask=manifest.loss_mask,
        eos_id=manifest.tokenizer.eos_id,
        documents=documents,
        preference=manifest.preference,
        preference_format=manifest.preference_format,
    )


# ---------------------------------------------------------------------------------------------------------
# An export directory, with transformers
# ---------------------------------------------------------------------------------------------------------


REWARD_METRIC = (
    "a reward model's mean Bradley-Terry loss over the held-out preference pairs, -log sigmoid(r(chosen) - "
    "r(rejected)); no perplexity"
)


def _is_classifier(directory: str, data: HeldOut) -> bool:
    """Whether the model in `directory` is a classifier (a reward model: objective reward's export), which is scored
    on preference pairs (its Bradley-Terry loss and reward accuracy, `model_rewards`) and has no next-token loss: on
    any other data a PylonError saying so."""
    from transformers import AutoConfig

    from pylon.models import is_classifier

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError):
        return False  # (loading the model says what is wrong)
    if not is_classifier(config):
        return False
    if not data.preference:
        raise PylonError(
            f"{directory}: a classifier ({', '.join(config.architectures)}: a reward model, a cross-encoder) has no "
            f"next-token loss to evaluate, and {data.dataset} holds no preference pairs to score it on; give a "
            "dataset prepared with `pylon data prepare --preference` (a reward model's run reports the same figures "
            "as val_reward_*, and a Deployment serves it on /classify and /pooling)"
        )
    if not data.documents:
        raise PylonError("attention mask causal: a reward model reads each completion on its own; use auto or document")
    return True


def _check_vocabulary(model, data: HeldOut) -> None:
    """Every held-out token id inside the model's vocabulary: else the dataset was prepared with another tokenizer."""
    vocab = model.config.vocab_size
    top = max((int(data.token_ids(s).max()) for s in data.sequences if len(s)), default=0)
    if top >= vocab:
        raise PylonError(
            f"{data.dataset}: token id {top} is outside the model's vocabulary of {vocab}; the dataset was "
            "prepared with another tokenizer than the model's"
        )


def model_rewards(
    directory: str, data: HeldOut, *, batch_size: int = 8, device: str | None = None, progress: bool = False
) -> tuple[float, int, str, dict]:
    """(mean Bradley-Terry loss, pairs, device, figures) of the reward model (a `*ForSequenceClassification` of one
    label) in the local `directory`, in fp32, on the held-out preference pairs batched as its training run batched
    them: each completion read where the trainer and serving read it (`pylon.jobs.dpo.document_rewards`), the pairs'
    accuracy, margin and mean rewards as the run's val_reward_* figures."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForSequenceClassification

    from pylon.jobs.dpo import document_rewards, pair_up
    from pylon.jobs.train import model_inputs
    from pylon.models import head_outputs, without_padding_warning

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            directory, dtype=torch.float32, local_files_only=True
        )
    except (OSError, ValueError) as e:
        raise PylonError(f"{directory}: cannot load a Hugging Face classifier from it ({e})") from None
    if model.config.num_labels != 1:
        raise PylonError(f"{directory}: a classifier of {model.config.num_labels} labels is not a reward model (one)")
    model.to(device).eval()
    without_padding_warning(model)
    _check_vocabulary(model, data)
    eos = getattr(model.config, "eos_token_id", None)
    conversations = data.preference_format == "conversational"
    sums = torch.zeros(5, dtype=torch.float64)  # loss, pairs, correct, chosen, rejected
    bar = tqdm(total=len(data.sequences), unit="seq", file=sys.stderr, disable=not progress, desc="evaluating")
    with torch.no_grad():
        for n_rows, inputs in data.batches(batch_size, device):
            with head_outputs(model) as heads:
                model(**model_inputs(inputs))
            scores = heads[-1][..., 0]
            rewards = document_rewards(scores, inputs["labels"], inputs["position_ids"], eos, conversations)
            chosen, rejected = pair_up(*rewards, data.dataset)
            losses = -torch.nn.functional.logsigmoid(chosen - rejected)
            count, correct = losses.new_tensor(float(losses.numel())), (chosen > rejected).sum().to(losses.dtype)
            sums += torch.stack([losses.sum(), count, correct, chosen.sum(), rejected.sum()]).double().cpu()
            bar.update(n_rows)
    bar.close()
    loss, pairs, figures = _reward_figures(data, *sums.tolist())
    return loss, pairs, str(device), figures


def _reward_figures(data: HeldOut, loss: float, pairs: float, correct: float, chosen: float, rejected: float):
    """(mean loss, pairs, figures) from the sums over the held-out pairs: the trainer's val_reward_* arithmetic
    (`pylon.jobs.dpo.dpo_record`), its accuracy, margin and mean rewards; no pair is a PylonError."""
    from pylon.jobs.dpo import dpo_record

    if pairs == 0:
        raise PylonError(f"{data.dataset}: nothing to score: the held-out rows hold no preference pair")
    record = dpo_record(loss, pairs, chosen, rejected, correct, name="reward")
    figures = {k: record[k] for k in ("reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected")}
    return record["reward_loss"], int(pairs), figures


def model_loss(
    directory: str, data: HeldOut, *, batch_size: int = 8, device: str | None = None, progress: bool = False
) -> tuple[float, int, str]:
    """(mean loss, tokens, device) of the `transformers` model in the local `directory`, in fp32, on the held-out
    rows batched as the trainer batches them (full rows, padding masked out of the attention and the labels; each
    document on its own under `data.documents`)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from pylon.jobs.train import model_inputs, token_loss_sum

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as e:
        raise PylonError(f"{directory}: cannot load a Hugging Face causal LM from it ({e})") from None
    model.to(device).eval()
    if data.documents:
        from pylon.models import without_padding_warning

        without_padding_warning(model)  # the padding of a document batch is a segment of its own
    _check_vocabulary(model, data)
    loss_sum, tokens = 0.0, 0
    bar = tqdm(total=len(data.sequences), unit="seq", file=sys.stderr, disable=not progress, desc="evaluating")
    with torch.no_grad():
        for n_rows, inputs in data.batches(batch_size, device):
            logits = model(**model_inputs(inputs)).logits
            part, n = token_loss_sum(logits, inputs["labels"])
            loss_sum += float(part.item())
            tokens += n
            bar.update(n_rows)
    bar.close()
    if tokens == 0:
        raise PylonError("nothing to score: the held-out sequences have no token with a predecessor")
    return loss_sum / tokens, tokens, str(device)


# ---------------------------------------------------------------------------------------------------------
# A deployment, over HTTP
# ---------------------------------------------------------------------------------------------------------


def _base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _http_error(response, what: str, api_key_env: str) -> PylonError:
    """An HTTP error answer as a PylonError: the status, the server's own message, and what to do next."""
    try:
        error = response.json().get("error") or {}
        message = error.get("message") or response.text
        param = error.get("param")
    except ValueError:
        message, param = response.text.strip()[:500], None
    detail = f"{message} (param: {param})" if param else message
    hints = {
        401: f"set {api_key_env} (or the variable --api-key-env names) to one of the deployment's API keys",
        404: "check the URL (with its route prefix) and --model, the served model's name (GET /v1/models)",
        429: "the deployment is saturated; retry later or send fewer at once (--concurrency)",
        503: "the deployment is not ready or lost an engine; check `pylon serve` / Serve's status, then retry",
        504: "the deployment timed out; raise its http.request_timeout_s or send fewer at once (--concurrency)",
    }
    hint = hints.get(response.status_code)
    if hint is None and response.status_code == 400:
        hint = (
            "the deployment refused the scoring request; it must support echo: true with logprobs and "
            "max_tokens: 0 on token-id prompts, and the rows must fit its context (max_model_len)"
        )
    return PylonError(
        f"{what}: HTTP {response.status_code}: {detail}" + (f"; {hint}" if hint else ""),
    )


def served_model_name(url: str, session, api_key_env: str, timeout_s: float = 30.0) -> str:
    """The one model a deployment serves (`GET /v1/models`): its base model when the others are its LoRA adapters
    (cards with a `parent`: `--model NAME` evaluates one of them)."""
    import requests

    try:
        r = session.get(f"{url}/v1/models", timeout=timeout_s)
    except requests.RequestException as e:
        raise PylonError(f"{url}: cannot reach the deployment ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise _http_error(r, f"GET {url}/v1/models", api_key_env)
    cards = r.json().get("data", [])
    models = [m["id"] for m in cards]
    bases = [m["id"] for m in cards if not m.get("parent")]
    if len(bases) == 1:
        return bases[0]
    if len(models) != 1:
        raise PylonError(f"{url}: serves {len(models)} models ({', '.join(models)}); name one with --model")
    return models[0]


def endpoint_loss(
    endpoint: str,
    data: HeldOut,
    *,
    model: str | None = None,
    api_key: str | None = None,
    api_key_env: str = DEFAULT_API_KEY_ENV,
    concurrency: int = DEFAULT_CONCURRENCY,
    timeout_s: float = 300.0,
    progress: bool = False,
) -> tuple[float, int, str]:
    """(mean loss, tokens, served model name) of a deployment on the held-out rows: each row's prompt tokens'
    log-probabilities, at most `concurrency` requests in flight."""
    import requests
    from tqdm import tqdm

    url = _base_url(endpoint)
    if concurrency < 1:
        raise PylonError(f"concurrency {concurrency}: must be at least 1")
    local = threading.local()

    def session() -> requests.Session:
        if not hasattr(local, "session"):
            local.session = requests.Session()
            if api_key:
                local.session.headers["Authorization"] = f"Bearer {api_key}"
        return local.session

    name = model or served_model_name(url, session(), api_key_env)

    def score(seq: np.ndarray) -> tuple[float, int]:
        """A row's (summed loss, tokens counted): one prompt per piece (the row, or each of its documents)."""
        ids, counted = data.token_ids(seq), data.counted(seq)
        total, n = 0.0, 0
        for lo, hi in data.pieces(seq):
            part, k = score_prompt(ids[lo:hi], None if counted is None else counted[lo:hi])
            total, n = total + part, n + k
        return total, n

    def score_prompt(ids: np.ndarray, counted: np.ndarray | None) -> tuple[float, int]:
        if len(ids) < 2:  # nothing to predict: the trainer counts no token of it either
            return 0.0, 0
        body = {"model": name, "prompt": ids.tolist(), "echo": True, "logprobs": 0, "max_tokens": 0}
        try:
            r = session().post(f"{url}/v1/completions", json=body, timeout=timeout_s)
        except requests.RequestException as e:
            raise PylonError(f"{url}: request failed ({type(e).__name__}: {e})") from None
        if r.status_code != 200:
            raise _http_error(r, f"POST {url}/v1/completions", api_key_env)
        logprobs = (r.json().get("choices") or [{}])[0].get("logprobs")
        if not logprobs or "token_logprobs" not in logprobs:
            raise PylonError(
                f"{url}: the answer carries no prompt logprobs (choices[0].logprobs is {logprobs!r}); the "
                "deployment must support echo: true with logprobs: 0 and max_tokens: 0"
            )
        return prompt_loss_sum(logprobs["token_logprobs"], len(ids), counted)

    parts: list[tuple[float, int]] = [(0.0, 0)] * len(data.sequences)
    bar = tqdm(total=len(data.sequences), unit="seq", file=sys.stderr, disable=not progress, desc="scoring")
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        pending = {}
        todo = iter(enumerate(data.sequences))
        try:
            while True:
                while len(pending) < concurrency:  # bounded: never more than `concurrency` rows in flight
                    nxt = next(todo, None)
                    if nxt is None:
                        break
                    pending[pool.submit(score, nxt[1])] = nxt[0]
                if not pending:
                    break
                done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    parts[pending.pop(future)] = future.result()  # the first error ends the evaluation
                    bar.update(1)
        finally:
            for future in pending:
                future.cancel()
            bar.close()
    loss, tokens = reduce_losses(parts)
    return loss, tokens, name


def reward_spans(data: HeldOut, seq: np.ndarray) -> list[np.ndarray]:
    """The token ids a reward model reads of each document of a preference row, in row order: a text pair's
    completion up to its last counted token before the eos prepare appends, a conversation whole
    (`pylon.jobs.dpo.document_rewards`' rule, for a deployment's /classify, which reads an input's last token)."""
    import numpy as np

    ids, counted = data.token_ids(seq), data.counted(seq)
    spans = []
    for lo, hi in data.pieces(seq):
        doc, mark = ids[lo:hi], counted[lo:hi] if counted is not None else np.ones(hi - lo, bool)
        if not mark.any():
            continue  # (the padding)
        if data.preference_format == "conversational":
            spans.append(doc)
            continue
        text = np.flatnonzero(mark & (doc != data.eos_id))
        end = int(text[-1]) if text.size else int(np.flatnonzero(mark)[-1])
        spans.append(doc[: end + 1])
    return spans


def endpoint_rewards(
    endpoint: str,
    data: HeldOut,
    *,
    model: str | None = None,
    api_key: str | None = None,
    api_key_env: str = DEFAULT_API_KEY_ENV,
    timeout_s: float = 300.0,
    progress: bool = False,
) -> tuple[float, int, str, dict] | None:
    """(mean Bradley-Terry loss, pairs, served model name, figures) of a deployment of a reward model on the held-out
    preference pairs: each row's completions, read as `reward_spans` says, sent as token ids to `POST /classify`
    (raw values: `use_activation: false`), paired two by two, chosen first. None when the deployment is not a
    classifier (its /classify says so): its completions' perplexity is then what is scored."""
    import math as _math

    import requests
    from tqdm import tqdm

    url = _base_url(endpoint)
    http = requests.Session()
    if api_key:
        http.headers["Authorization"] = f"Bearer {api_key}"
    name = model or served_model_name(url, http, api_key_env)
    totals = [0.0, 0, 0, 0.0, 0.0]  # loss, pairs, correct, chosen, rejected
    bar = tqdm(total=len(data.sequences), unit="seq", file=sys.stderr, disable=not progress, desc="scoring")
    try:
        for seq in data.sequences:
            spans = reward_spans(data, seq)
            if not spans:
                bar.update(1)
                continue
            if len(spans) % 2:
                raise PylonError(
                    f"{data.dataset}: a row holds {len(spans)} documents, not preference pairs; a reward model is "
                    "scored on a dataset prepared with `pylon data prepare --preference`"
                )
            body = {"model": name, "input": [s.tolist() for s in spans], "use_activation": False}
            try:
                r = http.post(f"{url}/classify", json=body, timeout=timeout_s)
            except requests.RequestException as e:
                raise PylonError(f"{url}: request failed ({type(e).__name__}: {e})") from None
            if r.status_code == 400 and "not a classifier" in r.text and totals[1] == 0:
                return None
            if r.status_code != 200:
                raise _http_error(r, f"POST {url}/classify", api_key_env)
            values = [float(item["probs"][0]) for item in sorted(r.json()["data"], key=lambda d: d["index"])]
            for chosen, rejected in zip(values[0::2], values[1::2]):
                margin = chosen - rejected
                totals[0] += _math.log1p(_math.exp(-margin)) if margin > -30 else -margin  # -log sigmoid
                totals[1] += 1
                totals[2] += chosen > rejected
                totals[3] += chosen
                totals[4] += rejected
            bar.update(1)
    finally:
        bar.close()
    loss, pairs, figures = _reward_figures(data, *totals)
    return loss, pairs, name, figures


# ---------------------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------------------


def is_endpoint(model_or_endpoint: str) -> bool:
    return model_or_endpoint.startswith(("http://", "https://"))


def evaluate(
    model_or_endpoint: str,
    *,
    data: str | None = None,
    validation_fraction: float | None = None,
    max_sequences: int | None = None,
    model: str | None = None,
    api_key: str | None = None,
    api_key_env: str = DEFAULT_API_KEY_ENV,
    concurrency: int = DEFAULT_CONCURRENCY,
    batch_size: int = 8,
    device: str | None = None,
    attention_mask: str | None = None,
    progress: bool = False,
) -> Evaluation:
    """The perplexity of a model on a prepared dataset's held-out split (see this module's docstring).

    `model_or_endpoint`: an export directory (local or s3://) or a deployment's base URL (http(s)://). For an
    export with `eval.json`, `data` and `validation_fraction` default to the dataset and fraction its training
    run evaluated on; otherwise both are required. `max_sequences`: the split's first N rows only. Endpoint only:
    `model` (default: the one the deployment serves), `api_key` (default: the first of the comma-separated keys
    in environment variable `api_key_env`), `concurrency` (requests in flight). Model only: `batch_size`,
    `device` (default: cuda if available, else cpu). `attention_mask`: how a row packed from several documents is
    attended, as TrainJob's field says (auto, causal, document; a deployment scores each document as its own
    prompt); default: as the export's training run attended them (its eval.json), else auto."""
    from pylon.jobs.export import read_export_eval
    from pylon.sdk.inputs import first_api_key

    t0 = time.perf_counter()
    endpoint = is_endpoint(model_or_endpoint)
    recorded = None if endpoint else read_export_eval(model_or_endpoint)
    if data is None:
        data = recorded.get("dataset") if recorded else None
    if validation_fraction is None:
        validation_fraction = recorded.get("validation_fraction") if recorded else None
    missing = [
        flag for flag, value in (("--data", data), ("--validation-fraction", validation_fraction)) if value is None
    ]
    if missing:
        why = (
            "an endpoint does not say what it was trained on"
            if endpoint
            else f"{model_or_endpoint} has no eval.json (its run had no validation split) to take them from"
        )
        raise PylonError(
            f"{' and '.join(missing)} required: {why}; give the training run's data.uri (--data URI) and "
            "data.validation_fraction (--validation-fraction F)"
        )
    if attention_mask is None:
        attention_mask = (recorded or {}).get("attention_mask", "auto")
    held = held_out(data, float(validation_fraction), max_sequences, attention_mask=attention_mask)
    rewards = None  # a reward model's figures
    if endpoint:
        key = api_key if api_key is not None else first_api_key(api_key_env, required=False)
        scored = None
        if held.preference and held.documents:  # a reward model's deployment scores the pairs on /classify
            scored = endpoint_rewards(
                model_or_endpoint, held, model=model, api_key=key, api_key_env=api_key_env, progress=progress
            )
        if scored is not None:
            loss, tokens, served, rewards = scored
        else:
            loss, tokens, served = endpoint_loss(
                model_or_endpoint,
                held,
                model=model,
                api_key=key,
                api_key_env=api_key_env,
                concurrency=concurrency,
                progress=progress,
            )
        where, run_on = _base_url(model_or_endpoint), None
    else:
        from pylon.models import local_model_dir
        from pylon.serving.model.eagle import refuse_as_model

        with local_model_dir(model_or_endpoint) as directory:
            refuse_as_model(directory, model_or_endpoint)  # (a drafting head: no model of its own to evaluate)
            _check_tokenizer(directory, model_or_endpoint, held)
            if _is_classifier(directory, held):
                loss, pairs, run_on, rewards = model_rewards(
                    directory, held, batch_size=batch_size, device=device, progress=progress
                )
                tokens = pairs
            else:
                loss, tokens, run_on = model_loss(
                    directory, held, batch_size=batch_size, device=device, progress=progress
                )
        where, served = model_or_endpoint, None
    # Recorded for the same data only: a figure over other data would only mislead.
    same = recorded and recorded.get("dataset") == data and recorded.get("validation_fraction") == validation_fraction
    scored_pairs = rewards is not None
    return Evaluation(
        loss=loss,
        perplexity=None if scored_pairs else _perplexity(loss),
        tokens=tokens,
        sequences=len(held.sequences),
        source="endpoint" if endpoint else "model",
        model=where,
        served_model=served,
        device=run_on,
        dataset=data,
        split="validation",
        validation_fraction=float(validation_fraction),
        ids=list(held.ids),
        seconds=round(time.perf_counter() - t0, 3),
        recorded=recorded if same else None,
        attention_mask="document" if held.documents else "causal",
        metric=REWARD_METRIC if scored_pairs else METRIC,
        pairs=tokens if scored_pairs else None,
        rewards=rewards,
    )


def _check_tokenizer(directory: str, where: str, held: HeldOut) -> None:
    """An export's `pylon_tokenizer.json` must be the dataset's tokenizer (the same ids mean the same text)."""
    import json
    import os

    from pylon.jobs.export import TOKENIZER_FILE

    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.exists(path):
        return  # a plain Hugging Face directory: the vocabulary check in model_loss is all there is
    with open(path) as f:
        mine = json.load(f)
    keys = ("kind", "name", "vocab_size", "sha256")
    if any(mine.get(k) != held.tokenizer.get(k) for k in keys):
        a = {k: mine.get(k) for k in keys}
        b = {k: held.tokenizer.get(k) for k in keys}
        raise PylonError(
            f"{where} was trained with tokenizer {a}, {held.dataset} was prepared with {b}: "
            "evaluate on data prepared with the model's tokenizer"
        )
