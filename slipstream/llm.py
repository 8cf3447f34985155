"""`LLM`: offline batch generation over an Engine, in vLLM's shape."""
from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from slipstream.engine.args import EngineArgs
from slipstream.engine.engine import Engine, PromptType
from slipstream.engine.outputs import RequestOutput
from slipstream.sampling_params import SamplingParams


def checked_max_logprobs(value) -> int:
    """`max_logprobs` as given, or ValueError: -1 (no limit) or at least 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"max_logprobs must be -1 (no limit) or at least 0, got {value!r}")
    return value


class LLM:
    """Load a model once, then generate for batches of prompts.

    >>> llm = LLM()                      # the default model, SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> print(out[0].outputs[0].text)

    `model` is a Hugging Face folder (config.json + safetensors) or a `.gguf`
    file; keyword arguments are the fields of `EngineArgs` (dtype, device,
    max_model_len, block_size, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, enable_chunked_prefill, num_kv_blocks,
    kv_cache_memory, gpu_memory_utilization, kv_cache_dtype ("auto", "int8", "fp8", "kivi4", "kivi2"),
    attention_backend, seed, load_format:
    "dummy" builds the model with random weights, see loader/dummy.py).
    `max_logprobs` (vLLM's, 20) is the most logprobs / prompt_logprobs a request of
    `generate` may ask for (-1, the whole vocabulary, counts as its size); -1: no limit.
    """

    def __init__(self, model: str | None = None, *, max_logprobs: int = 20, **kwargs):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown options: {', '.join(sorted(unknown))}")
        self.max_logprobs = checked_max_logprobs(max_logprobs)
        self.engine = Engine(EngineArgs(model=model, **kwargs))

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (and prefill process), if any;
        the LLM cannot generate after this."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt blocks (False, and nothing reset, while requests
        are unfinished)."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in prompt order. A prompt
        is text or {"prompt_token_ids": [...]}; `sampling_params` is a SamplingParams
        (for every prompt) or a list of them (one per prompt); a dict of options is
        refused with a TypeError, as vLLM does: pass SamplingParams(**options)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            if isinstance(sampling_params, (dict, str)):
                raise _not_sampling_params(sampling_params)
            try:
                params = list(sampling_params)
            except TypeError:
                raise _not_sampling_params(sampling_params) from None
            for sp in params:
                if not isinstance(sp, SamplingParams):
                    raise _not_sampling_params(sp)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        # Validate and tokenize everything before anything runs.
        for p, sp in zip(prompts, params):
            self.engine.tokenize(p)
            self.engine.check_params(sp)
            self._check_logprobs(sp)
        loop = self.engine.loop_path()
        if loop is not None and loop.accepts(prompts, params):
            return [loop.generate(prompts[0], params[0])]
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except BaseException:
            for rid in ids:             # none of the call's requests stays behind
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def _check_logprobs(self, sp: SamplingParams) -> None:
        """logprobs / prompt_logprobs within max_logprobs (-1, the whole vocabulary,
        counts as its size), as vLLM checks them."""
        cap = self.max_logprobs
        if cap == -1:
            return
        vocab = self.engine.config.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(sp, name)
            if value is None:
                continue
            n = vocab if value == -1 else value
            if n > cap:
                what = f"-1 (the whole vocabulary, {vocab})" if value == -1 else str(value)
                raise ValueError(f"{name}={what} exceeds max_logprobs={cap}; "
                                 "LLM(max_logprobs=N) raises the limit (-1: none)")

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of
        {"role", "content"} dicts) or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = []
        for conv in conversations:
            conv = [_text_content(m) for m in conv]
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            # The template already wrote any BOS token into the text.
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm or len(ids) < 2,
                   dynamic_ncols=True)
        n_in = n_out = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        done[out.request_id] = out
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"in {n_in / elapsed:.0f} tok/s, out {n_out / elapsed:.0f} tok/s")
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]


def _not_sampling_params(got) -> TypeError:
    hint = ": build SamplingParams(**options) from it" if isinstance(got, dict) else ""
    return TypeError(f"sampling_params: expected a SamplingParams or a list of them (one per "
                     f"prompt), got a {type(got).__name__}{hint}")


def _text_content(message: dict) -> dict:
    """OpenAI's content parts ([{"type": "text", "text": ...}]) joined into one string,
    as the server does; other part types are refused."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages: only text content parts are supported, got {part!r}")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}
