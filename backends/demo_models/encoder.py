"""A tiny random-weight BERT sentence encoder, as Hugging Face and its ONNX export write it.

`write_tiny_encoder(out_dir)` trains a small WordPiece `tokenizer.json` (BERT normalization,
[CLS] ... [SEP]), builds a random-weight `BertModel` (saved with `save_pretrained` under `hf/`, so
`transformers` can load the same weights) and exports it to ONNX with inputs `input_ids`,
`attention_mask`, `token_type_ids` and output `last_hidden_state` [batch, tokens, hidden], dynamic
in batch and tokens. For `embedding:` deployments in tests and benches; needs torch and transformers.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

#: a few sentences in several scripts, so the vocabulary has accented, CJK and plain pieces
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "embeddings on intel cpus behind tenant keys",
    "héllo wörld, ça va très bien",
    "你好 世界 日本語 テキスト",
    "a gateway for a heterogeneous inference fleet",
]


@dataclass(frozen=True)
class TinyEncoder:
    onnx_path: pathlib.Path
    #: the folder holding tokenizer.json (the deployment's `embedding.tokenizer`)
    tokenizer_dir: pathlib.Path
    #: the same weights for `transformers.BertModel.from_pretrained`
    hf_dir: pathlib.Path
    hidden_size: int


def _tokenizer(out_dir: pathlib.Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(_CORPUS * 20, WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.decoder = decoders.WordPiece()
    tok.save(str(out_dir / "tokenizer.json"))
    return tok.get_vocab_size()


def write_tiny_encoder(out_dir: pathlib.Path, hidden_size: int = 32, seed: int = 0) -> TinyEncoder:
    import torch
    from transformers import BertConfig, BertModel

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out_dir, vocab_size=400)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=512,
    )
    model = BertModel(config).eval()
    model.save_pretrained(out_dir / "hf")

    class LastHiddenState(torch.nn.Module):
        def __init__(self, bert: BertModel) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def]
            return self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = tuple(torch.ones((1, 4), dtype=torch.int64) for _ in names)
    onnx_path = out_dir / "encoder.onnx"
    torch.onnx.export(
        LastHiddenState(model),
        example,
        str(onnx_path),
        input_names=names,
        output_names=["last_hidden_state"],
        dynamic_axes={n: {0: "batch", 1: "tokens"} for n in [*names, "last_hidden_state"]},
        opset_version=17,
        dynamo=False,
    )
    return TinyEncoder(onnx_path=onnx_path, tokenizer_dir=out_dir, hf_dir=out_dir / "hf", hidden_size=hidden_size)
