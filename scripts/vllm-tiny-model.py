"""Builds the tiny model the real-vLLM tests serve: no weights (vLLM runs it with
`--load-format dummy`, random weights), a Llama architecture small enough for one CPU core, and a
byte-level BPE tokenizer trained here on the repository's own text, with a Llama-3-style chat template.

    python scripts/vllm-tiny-model.py OUT_DIR CORPUS_FILE...

Writes OUT_DIR/config.json, tokenizer.json, tokenizer_config.json and generation_config.json. The
output is a pure function of the corpus files and this script: training is single-threaded and the
corpus order is the command line's, so the same inputs give the same tokenizer byte for byte.
Runs with the vLLM venv's Python (scripts/provision-vllm), which has `tokenizers`.
"""

import json
import os
import sys

# Deterministic training: one thread, no parallel merges.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

VOCAB = 4096
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, corpus = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(corpus, trainer)
    bos_id = tokenizer.token_to_id(BOS)
    eos_id = tokenizer.token_to_id(EOS)
    # Plain text gets the BOS from the post-processor; a chat gets it from the template (and the
    # engine tokenizes a rendered chat without special tokens).
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()

    write(out, "tokenizer_config.json", {
        "bos_token": BOS,
        "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    })
    write(out, "config.json", {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    })
    write(out, "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    print(f"vllm-tiny-model: {out}: vocab {vocab}, trained on {len(corpus)} files", file=sys.stderr)
    return 0


def write(out: str, name: str, value: dict) -> None:
    with open(os.path.join(out, name), "w", encoding="utf-8") as file:
        json.dump(value, file, indent=2, sort_keys=True)
        file.write("\n")


if __name__ == "__main__":
    sys.exit(main())
