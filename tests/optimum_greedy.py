"""optimum-onnx's own export of Hugging Face Marian directories, and their greedy translations.

Run by tests/test_export_huggingface.py in a Python that has `optimum-onnx`
(`KT_OPTIMUM_PYTHON`, or the test's own when it imports optimum): optimum
0.1.0 requires transformers<4.58, this project transformers>=5, so the two
usually live in different environments. Standard library, torch, transformers
and optimum only; nothing from this project.

    python tests/optimum_greedy.py < request.json > answer.json

The request: `{"models": [{"directory": HF_DIR, "output": ONNX_DIR}], "sentences": [...],
"max_extra_length": N}`. The answer, for each model in order: `{"ids": [[...]],
"texts": [...], "files": [...]}`: the greedy ids of each sentence translated
alone (decoder start included, as `generate` returns them), their decoded
texts, and the ONNX files optimum wrote.
"""

import json
import os
import sys


def main():
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM
    from transformers import MarianTokenizer

    request = json.load(sys.stdin)
    answer = []
    for entry in request["models"]:
        # optimum's own exporter (torch.onnx), its own ONNX Runtime session and generation loop.
        model = ORTModelForSeq2SeqLM.from_pretrained(entry["directory"], export=True)
        model.save_pretrained(entry["output"])
        tokenizer = MarianTokenizer.from_pretrained(entry["directory"])
        ids = []
        for sentence in request["sentences"]:
            source = tokenizer(sentence)["input_ids"]
            output = model.generate(input_ids=torch.tensor([source]), num_beams=1, do_sample=False,
                                    max_length=len(source) + request["max_extra_length"] + 1)
            ids.append(output[0].tolist())
        answer.append({"ids": ids, "texts": tokenizer.batch_decode(ids, skip_special_tokens=True),
                       "files": sorted(os.listdir(entry["output"]))})
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
