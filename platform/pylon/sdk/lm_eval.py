"""lm-evaluation-harness (`lm-eval`, pylon[eval]) against a Pylon deployment: its `local-completions` model.

    from pylon.sdk.lm_eval import completions_model, hf_tokenizer_dir
    lm = completions_model("http://127.0.0.1:8000", tokenizer=hf_tokenizer_dir("./model", "./model-tokenizer"),
                           api_key_env="PYLON_API_KEYS")
    results = lm_eval.simple_evaluate(model=lm, tasks=[...])

For log-likelihood tasks (multiple choice, perplexity) lm-eval tokenizes each context and continuation itself
(it must know where the continuation starts) and sends token-id prompts to `POST /v1/completions` with
`echo: true, logprobs: 1, max_tokens: 1, temperature: 0`, then sums `token_logprobs[ctxlen:-1]`: the prompt's
continuation tokens, the generated token dropped. It needs the model's tokenizer as a Hugging Face tokenizer
(`tokenizer_backend=huggingface`; with `tokenizer_backend=None` it "tokenizes" a string as one token, which is
wrong for log-likelihoods). `hf_tokenizer_dir` gives one for any Pylon export. lm-eval's `local-completions`
sends `Authorization: Bearer ` with an empty key and has no option for one: `completions_model` is that model with
the deployment's key; from the command line, the same model is `--model pylon-completions` (below).

lm-eval 0.4.9 does not import under transformers 5 (its VLM model names `transformers.AutoModelForVision2Seq`,
which transformers 5 renamed `AutoModelForImageTextToText`): `import_lm_eval()` supplies the old name first, and
`python -m pylon.sdk.lm_eval ARGS...` is the `lm_eval` command with it (and with `pylon-completions` registered):

    python -m pylon.sdk.lm_eval --model pylon-completions \
        --model_args base_url=http://127.0.0.1:8000,tokenizer=./model-tokenizer,api_key_env=PYLON_API_KEYS \
        --include_path examples/lm_eval --tasks pylon_mc
"""

from __future__ import annotations

import json
import os
import sys

from pylon.errors import PylonError

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_tokenizer_dir(model_dir: str, out: str | None = None) -> str:
    """A local directory `transformers.AutoTokenizer.from_pretrained` loads as the tokenizer of the export in the
    local `model_dir`: the export itself when it carries Hugging Face tokenizer files (exports of `tokenizers`
    BPE and Hugging Face tokenizers do), else, for Pylon's byte tokenizer (which needs no files), an exact
    equivalent written to `out`: UTF-8 bytes as ids 0-255, eos 256, pad 257."""
    from pylon.jobs.export import TOKENIZER_FILE

    path = os.path.join(model_dir, TOKENIZER_FILE)
    info = json.loads(open(path).read()) if os.path.exists(path) else {}
    if info.get("kind") == "byte":
        if out is None:
            raise PylonError(f"{model_dir}: a byte-tokenizer model; give a directory to write its tokenizer files to")
        write_byte_tokenizer(out, vocab_size=info["vocab_size"], eos_id=info["eos_id"], pad_id=info["pad_id"])
        return out
    if any(os.path.exists(os.path.join(model_dir, f)) for f in HF_TOKENIZER_FILES):
        return model_dir
    raise PylonError(
        f"{model_dir}: no Hugging Face tokenizer files ({', '.join(HF_TOKENIZER_FILES)}) and not a byte-tokenizer "
        "export; export the run again with `pylon export` (it copies the tokenizer), or copy its files in"
    )


def write_byte_tokenizer(out: str, *, vocab_size: int = 320, eos_id: int = 256, pad_id: int = 257) -> None:
    """Pylon's byte tokenizer (`pylon.data.tokenizer.ByteTokenizer`) as Hugging Face tokenizer files: byte-level
    BPE with no merges, byte b's symbol at id b, so every string encodes to its UTF-8 bytes and back; eos and pad
    are special tokens at their ids, the ids between them and `vocab_size` unused placeholders."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from pylon.serving.engine.tokenization import bytes_to_unicode

    symbols = bytes_to_unicode()
    vocab = {symbols[b]: b for b in range(256)}
    names = {eos_id: "<|endoftext|>", pad_id: "<|pad|>"}
    for i in range(256, vocab_size):
        vocab[names.get(i, f"<|unused_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([names[eos_id], names[pad_id]])
    assert sorted(ByteLevel.alphabet()) == sorted(symbols.values())
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names[eos_id],
        "eos_token": names[eos_id],
        "pad_token": names[pad_id],
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")


def completions_model(
    endpoint: str,
    *,
    tokenizer: str,
    model: str | None = None,
    api_key: str | None = None,
    api_key_env: str | None = None,
    max_length: int | None = None,
    **kwargs,
):
    """lm-eval's `local-completions` model on a Pylon deployment (base URL), with its API key (`api_key`, or the
    first key in environment variable `api_key_env`) and the served model's name and context length from
    `GET /v1/models` unless given. `tokenizer`: a Hugging Face tokenizer directory (`hf_tokenizer_dir`). Other
    keyword arguments go to lm-eval's model (num_concurrent, max_retries, timeout, ...)."""
    return _model_class()(
        endpoint,
        tokenizer=tokenizer,
        model=model,
        api_key=api_key,
        api_key_env=api_key_env,
        max_length=max_length,
        **kwargs,
    )


def import_lm_eval():
    """`lm_eval`, imported so that 0.4.9 loads under transformers 5: the name its VLM model class reads at import,
    `transformers.AutoModelForVision2Seq`, is supplied as transformers 5's `AutoModelForImageTextToText` when
    missing. (`evaluate`, which lm_eval imports, replaces the `transformers` module object: it goes first.)"""
    import evaluate  # noqa: F401
    import transformers

    if not hasattr(transformers, "AutoModelForVision2Seq") and hasattr(transformers, "AutoModelForImageTextToText"):
        transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText
    import lm_eval

    return lm_eval


_MODEL_CLASS = None


def _model_class():
    """lm-eval's `local-completions` with a Pylon deployment's base URL, key, model name and context length;
    registered with lm-eval as `pylon-completions` (model_args: base_url, tokenizer, api_key_env, model, ...)."""
    global _MODEL_CLASS
    if _MODEL_CLASS is not None:
        return _MODEL_CLASS
    import_lm_eval()
    import requests
    from lm_eval.api.registry import register_model
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from pylon.sdk.evaluate import _base_url, _http_error
    from pylon.sdk.inputs import first_api_key

    @register_model("pylon-completions")
    class PylonCompletions(LocalCompletionsAPI):
        def __init__(
            self,
            base_url: str,
            *,
            tokenizer: str,
            model: str | None = None,
            api_key: str | None = None,
            api_key_env: str | None = None,
            max_length: int | None = None,
            **kwargs,
        ):
            url = _base_url(base_url)
            key = api_key
            if key is None and api_key_env:
                key = first_api_key(api_key_env, required=False)
            self._pylon_key = key
            if model is None or max_length is None:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = requests.get(f"{url}/v1/models", headers=headers, timeout=30)
                if r.status_code != 200:
                    raise _http_error(r, f"GET {url}/v1/models", api_key_env or "the API key variable")
                served = r.json()["data"][0]
                model = model or served["id"]
                max_length = max_length or served.get("max_model_len") or 2048
            kwargs.setdefault("tokenizer_backend", "huggingface")
            kwargs.setdefault("tokenized_requests", True)
            super().__init__(
                base_url=f"{url}/v1/completions", model=model, tokenizer=tokenizer, max_length=int(max_length), **kwargs
            )

        @property
        def header(self) -> dict:
            return {"Authorization": f"Bearer {self._pylon_key}"} if self._pylon_key else {}

    _MODEL_CLASS = PylonCompletions
    return PylonCompletions


def main(argv: list[str] | None = None) -> None:
    """The `lm_eval` command, importable under transformers 5, with `--model pylon-completions` registered."""
    _model_class()
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
