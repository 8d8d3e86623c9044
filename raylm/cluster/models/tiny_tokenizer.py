"""The tokenizer of the tiny checkpoints: a byte-level BPE trained offline on a seeded English-like corpus, with
Llama-3 style special tokens and a chat template. Deterministic for a given vocab size and seed."""
from __future__ import annotations

import functools
import random
from typing import Any

BOS, EOS, PAD, START, END = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|start|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START, END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n' }}{% endif %}"
)

_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_NOUNS = """time year people way day man woman child world life hand part place case week company system
program question work government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back parent face
others level office door health person art war history party result change morning reason research girl guy
moment air teacher force education river garden road window paper music table market forest bridge train
ship island mountain letter kitchen dog cat bird horse tree flower stone song doctor student village castle
machine engine signal message answer language network server model token cloud storm winter summer"""
_VERBS = """saw found made took gave told felt left kept began seemed helped showed heard played ran moved
lived believed brought wrote sat stood lost paid met included continued learned changed led understood
watched followed stopped created spoke read spent grew opened walked won offered remembered loved considered
appeared bought waited served died sent expected built stayed fell reached killed remained suggested raised
passed sold required reported decided pulled carried painted crossed visited answered counted cleaned"""
_ADJS = """good new first last long great little own other old right big high different small large next early
young important few public bad same able red blue green quiet bright dark warm cold happy sad strange simple
careful gentle heavy light rapid slow ancient modern hidden broken golden silver wooden empty full busy calm"""
_ADVS = "quickly slowly quietly often never always soon today yesterday together again already almost rather"
_PREPS = "in on at by with from into over under near behind across through after before during without toward"
_DETS = "the a this that every some no one another each my your his her our their"
_SYLLABLES = "ka lo mi ra ne to su vi da per gal tor en an is or bel dor mar lin fen rik sha thu wex zor qua".split()


def _corpus(seed: int, n_chars: int = 300_000) -> list[str]:
    """Seeded English-like sentences (plus invented names and numbers so BPE has enough merges to learn)."""
    rng = random.Random(seed)
    nouns, verbs, adjs = _NOUNS.split(), _VERBS.split(), _ADJS.split()
    advs, preps, dets = _ADVS.split(), _PREPS.split(), _DETS.split()
    names = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize() for _ in range(400)]

    def phrase() -> str:
        words = [rng.choice(dets)]
        if rng.random() < 0.6:
            words.append(rng.choice(adjs))
        words.append(rng.choice(nouns) + ("s" if rng.random() < 0.25 else ""))
        return " ".join(words)

    lines: list[str] = []
    total = 0
    while total < n_chars:
        subject = rng.choice(names) if rng.random() < 0.3 else phrase()
        parts = [subject, rng.choice(verbs), phrase(), rng.choice(preps), phrase()]
        if rng.random() < 0.3:
            parts.insert(2, rng.choice(advs))
        if rng.random() < 0.25:
            parts += ["in", str(rng.randint(1, 2100))]
        sentence = " ".join(parts)
        sentence = sentence[0].upper() + sentence[1:]
        kind = rng.random()
        if kind < 0.1:
            sentence = f'"{sentence}?" asked {rng.choice(names)}.'
        elif kind < 0.3:
            sentence += f", and {phrase()} {rng.choice(verbs)} {rng.choice(advs)}."
        else:
            sentence += "."
        lines.append(sentence)
        total += len(sentence) + 1
    return lines


@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int, seed: int) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # transformers 5 rebuilds the normalizer/pre-tokenizer of any qwen2 checkpoint as Qwen2Tokenizer does, so use
    # exactly those (NFC, Qwen split regex, ByteLevel): tokenizer.json and AutoTokenizer then agree for every arch.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama-3 style: encode() prepends bos; apply_chat_template tokenizes without special tokens, so no doubling.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok.to_str()


def build_tokenizer(vocab_size: int = 2048, seed: int = 0) -> Any:
    """A PreTrainedTokenizerFast around a freshly trained (cached) byte-level BPE."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size, seed)),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[START, END],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
