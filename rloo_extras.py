"""
Beyond one policy's RLOO step (rloo.py), what the scripts need of its engine:
- the two-turn teacher's sampling (METHOD.md "Two-turn teacher"; soar.py --teacher_turns 2, and
  eval.py's questions of such a teacher): the question, then its answer in a second turn;
- an HF folder served as it is (serve_hf): eval.py's inference rows, and lora.py's base put back.
It imports rloo and what rloo imports, nothing else of ours.
"""
import glob
import os

from safetensors import safe_open   # (comes with transformers) serve_hf reads HF folders

import rloo


def sample_turns(llm, prompt, k: int, *, answer_prompt: list[int], stop: str, turn_end,
                 max_tokens: int, temperature: float, seed: int,
                 group=None) -> tuple[list[tuple], list[str]]:
    """k two-turn samples (METHOD.md "Two-turn teacher"): turn 1 from `prompt`, ended at the first
    token where turn_end(text) (an index, or None while the turn is open) says it has ended (the
    engine stops at the string `stop`; turn_end may end it sooner), turn 2 from prompt + turn 1 +
    answer_prompt (token ids) with what turn 1 left of max_tokens; request i of turn 1 has seed + i,
    of turn 2 seed + k + i. Returns each sample's turns, (turn 1, turn 2), and its text: turns 1
    and 2 with answer_prompt between, as decoded by the engine's tokenizer; a turn 1 that did not
    end has no turn 2 and the text ""."""
    decode = llm.vllm.get_tokenizer().decode
    firsts = [_end_turn(o[0], turn_end, decode)
              for o in rloo.generate(llm, [prompt] * k, temperature=temperature,
                                     max_tokens=max_tokens, seed=seed, stop=stop, group=group)]
    closed = [i for i, s in enumerate(firsts)
              if turn_end(s.text) is not None and len(s.token_ids) < max_tokens]
    seconds = rloo.generate(llm, [list(prompt) + firsts[i].token_ids + answer_prompt
                                  for i in closed], temperature=temperature,
                            max_tokens=[max_tokens - len(firsts[i].token_ids) for i in closed],
                            seed=seed + k, group=group)
    samples = [(s,) for s in firsts]
    texts = [""] * k
    for i, out in zip(closed, seconds):
        samples[i] = (firsts[i], out[0])
        texts[i] = decode(firsts[i].token_ids + answer_prompt) + out[0].text
    return samples, texts


def turns_of(llm, prompt, *, answer_prompt: list[int], stop: str, turn_end, max_tokens: int,
             temperature: float, group=None):
    """sample_until's draw of two-turn samples: sample_turns of `prompt` with these settings"""
    return lambda k, seed: sample_turns(llm, prompt, k, answer_prompt=answer_prompt, stop=stop,
                                        turn_end=turn_end, max_tokens=max_tokens,
                                        temperature=temperature, seed=seed, group=group)


def _end_turn(sample: rloo.Sample, turn_end, decode) -> rloo.Sample:
    """sample cut after its first token whose text so far has ended (turn_end), as the engine cuts
    at a stop string: the shorter turn is as exact a sample; as it is where that is its end"""
    end = turn_end(sample.text)
    if end is None or end == len(sample.text):
        return sample
    ids = sample.token_ids
    lo, hi = 1, len(ids)   # the fewest tokens whose text has ended
    while lo < hi:
        mid = (lo + hi) // 2
        if turn_end(decode(ids[:mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    logprobs = sample.logprobs[:lo] if sample.logprobs is not None else None
    return rloo.Sample(decode(ids[:lo]), ids[:lo], sample.prompt_token_ids, logprobs)


def turns(sample) -> tuple:
    """the Samples of what sample_until kept: the one, or a two-turn sample's two"""
    return sample if isinstance(sample, tuple) else (sample,)


def serve_hf(llm, path: str) -> None:
    """The full weights of the HF folder `path` (or hub name) into this rank's engine, streamed
    from its safetensors files one tensor at a time (no trainer, no optimizer: an inference row of
    eval.py); requests are served by them from then on. The folder must hold the engine's
    architecture (a fine-tune of the model it was built from). A tied head is sent as the
    embedding: vLLM's reload_weights(weights_path=...) skips it and keeps the old head's logits
    (5.3 nats off in our tests). vLLM's reload also drops every adapter it holds
    (lora.serve_adapter loads them again)."""
    # the engine's own base (built from this name or folder): adapters can be served on it
    base = path == llm.base_path or os.path.realpath(path) == os.path.realpath(llm.base_path)
    if not os.path.isdir(path):   # a hub name: its files, downloaded once (as vLLM does)
        from transformers.utils.hub import snapshot_download   # (huggingface_hub's)
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights to serve")
    dtype = llm.vllm.llm_engine.model_config.dtype

    def weights():
        embedding = None
        head = False
        for file in files:
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name).to(dtype)
                    head |= name == "lm_head.weight"
                    if name == "model.embed_tokens.weight":
                        embedding = t
                    yield name, t
        if not head and embedding is not None:
            yield "lm_head.weight", embedding

    rloo.reload_engine(llm, weights(), base_replaced=not base)
