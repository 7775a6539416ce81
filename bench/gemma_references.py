"""Records llama.cpp's tokenization and greedy continuations for Gemma 3 270M (base, Q4_K_M GGUF):
the independent reference that kvshare's SentencePiece tokenizer (services/modelbuild/spm_tokenizer.py,
tests/test_gemma_tokenizer.py) and its converted ONNX graph are compared with.

Needs llama-cpp-python 0.3.36 in a venv of its own (standard library and llama_cpp only; the tests
do not need it):

    python3 -m venv /tmp/llamavenv && /tmp/llamavenv/bin/pip install llama-cpp-python==0.3.36
    /tmp/llamavenv/bin/python bench/gemma_references.py PATH/TO/gemma-3-270m-q4_k_m.gguf

It writes tests/fixtures/gemma3/llama_cpp_reference.json:
- "tokenize": hard strings, each with llama.cpp's ids as a user's text gets them (``add_bos=True,
  special=False``: control tokens such as ``<start_of_turn>`` are plain text, user-defined ones
  such as ``\\n\\n`` or ``<b>`` are still cut out) and as a chat template's text gets them
  (``add_bos=True, special=True``), and what llama.cpp's detokenizer makes of each (special tokens
  not rendered, nothing removed).
- "end_of_generation_ids": the tokens at which llama.cpp stops generating (``llama_vocab_is_eog``).
- "greedy": natural English prompts (short ones, one of 500–505 tokens so that the 16 new tokens
  cross position 512, Gemma 3's sliding window, and two of 700 or more, one of 1,500–1,600), their
  ids (with BOS, ``special=False``), the first 16 greedy new tokens (EOS ignored), and at each new
  position llama.cpp's top-1 and top-2 ids and the logit margin between them, so that a test can
  tell near-ties from real disagreements.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path

import llama_cpp

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gemma3" / "llama_cpp_reference.json"
NEW_TOKENS = 16
N_CTX = 2048
SLIDING_WINDOW = 512

TEXTS = [
    "",
    " ",
    "   three leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e      f",
    " " * 40 + "forty spaces, more than the longest run token",
    "\tTabs\t\tand\t\t\ttabs\t",
    "line one\nline two\n\nline three\n\n\n\nend\n",
    "\n" * 35 + "thirty-five newlines",
    "mixed \t \n \r\n whitespace\u3000ideographic\u00a0no-break  \n\t end",
    "  \n  \n\t \t",
    "\r\nWindows\r\nline endings\r\n",
    "Digits 0123456789, pi 3.14159265358979, 1,000,000,000 and the date 2024-06-30T12:00:00Z.",
    "12345678901234567890123456789012345678901234567890",
    "東京は日本の首都です。北京是中国的首都。",
    "서울은 한국의 수도입니다. 안녕하세요!",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Ελληνικά, русский язык и ภาษาไทย",
    "Emoji 😀🎉👍🏽 and ZWJ families 👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈",
    "Flags 🇫🇷🇯🇵🇺🇸🇧🇷 in a row",
    "Ünïcödé àccents: naïve café, Straße, œuvre, Ångström, and a combining e\u0301.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    'for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n',
    '<div class="note"><b>bold</b> and <i>italic</i></div>\n<table><tr><td>1</td></tr></table>',
    "https://example.com/path/to/page?a=1&b=two#frag and mailto:someone@example.org",
    "Rare: \U00010348 \U00013000 \ua66e \U0001F9FF \ue000 \U0010fffd \U000e0041",
    "a replacement character \ufffd in the middle",
    "control \x00\x01\x07 \x1b[31mred\x1b[0m and delete\x7f",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffBOM",
    "a literal \u2581 lower block and \u2581\u2581 two",
    "<start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text between<eos> specials",
    "<unused0> and <unused6241> and <mask>, <pad>, <unk>",
    "Tags <b>bold</b>, <code>x = 1</code>, [multimodal] and <start_of_image>",
    "Almost specials: <start_of_turn <bos </s> <s> <0x41> <unused>",
    "<start_of_turn><start_of_turn><<bos>>",
    "....!!!???---===___*** and aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "abc東京123😀xyz",
    "Mr. O\u2019Neil\u2019s dog\u2014it\u2019s 5\u00b0C\u2014didn\u2019t bark\u2026 \u201cquoted\u201d",
    "∑_{i=1}^{n} x_i² ≤ √(a+b) ≠ ∞ → ∀x∈ℝ",
    "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
]

PARAGRAPHS = [
    ("The lighthouse at the end of the northern breakwater was built in 1874, when the harbour still "
     "sheltered a fleet of wooden fishing boats. Its first keeper, a retired sailor named Thomas Hale, "
     "kept a logbook in which he noted the weather at every change of watch, the ships that passed, and "
     "the occasional seal that hauled itself onto the rocks below the tower. The lamp burned paraffin and "
     "had to be trimmed twice a night, a task Hale described as tedious but never dull, because the light "
     "had to turn without a pause from dusk until the sun rose again over the grey water."),

    ("Bread dough behaves differently in every season. In winter the kitchen is cold, the yeast works "
     "slowly, and a loaf may need four or five hours to rise; in summer the same dough can overflow its "
     "bowl in ninety minutes. Experienced bakers learn to watch the dough rather than the clock. They "
     "press a floured finger into its surface and wait: if the dent springs back at once, the dough needs "
     "more time, and if it stays without collapsing, the loaf is ready for the oven. The crust forms best "
     "when the first ten minutes of baking happen in a humid oven."),

    ("Every autumn, millions of small songbirds leave the forests of northern Europe and fly south toward "
     "Africa. Many of them travel at night, navigating by the stars and by the Earth's magnetic field, and "
     "rest during the day in hedges, gardens and reed beds. A warbler that weighs less than a coin may "
     "double its body weight before the journey, storing fat that it burns steadily over the Mediterranean "
     "and the Sahara. Researchers who fit tiny tags to these birds have found that some individuals return "
     "to the very same bush, year after year, after a round trip of more than ten thousand kilometres."),

    ("Keeping a bicycle in good condition takes less effort than most people expect. The chain should be "
     "wiped and oiled every few weeks, more often after rides in the rain, and the tyres should be pumped "
     "to the pressure printed on their sidewalls. Brake pads wear down gradually, so it is worth checking "
     "them at the start of each month; a thin pad squeals and stops the wheel more slowly. Finally, a quick "
     "look at the spokes and the quick-release levers before a long ride can prevent an unpleasant surprise "
     "far from home, when no repair shop is open."),

    ("A cold front forms where a mass of cold air pushes under warmer, lighter air and lifts it upward. As "
     "the warm air rises, it cools, and the moisture it carries condenses into tall clouds that can bring "
     "heavy showers, gusty winds and sometimes thunder. After the front passes, the sky often clears "
     "quickly, the temperature drops by several degrees, and the wind turns to come from the north or west. "
     "Forecasters follow these fronts on satellite images and pressure charts, and a sharp line of clouds "
     "stretching across hundreds of kilometres is one of the easiest patterns to recognise."),

    ("When Clara opened the old trunk in her grandmother's attic, she expected to find linen or letters. "
     "Instead, wrapped in a faded blue scarf, there was a small brass telescope with a name engraved along "
     "its barrel. She carried it down the narrow stairs, cleaned the lenses with the corner of her sleeve, "
     "and pointed it out of the kitchen window toward the hills. The image was blurred at first, but as "
     "she turned the eyepiece, a distant farmhouse came into focus, and on its roof, to her surprise, stood "
     "a weathervane shaped exactly like the one on the lid of the trunk."),

    ("Libraries have organised their books in many ways over the centuries. Some early collections simply "
     "shelved volumes by size, so that the largest folios rested on the lowest shelves and small books sat "
     "near the ceiling. Later, librarians grouped books by subject, and in the nineteenth century several "
     "decimal systems were proposed, giving each topic a number that could be divided into finer and finer "
     "classes. Today most readers search a digital catalogue first, yet the call number on the spine still "
     "decides where a book lives and which neighbours a curious browser will discover beside it."),

    ("A healthy river is more than moving water. Its banks are held together by the roots of willows and "
     "alders, its gravel beds give trout a place to lay their eggs, and its slow pools shelter insects that "
     "feed fish, birds and bats. When a river is straightened into a channel, the water runs faster, the "
     "gravel is washed away, and many of these habitats disappear. In recent years, several towns have "
     "restored the bends of their rivers, planted trees along the banks and removed old weirs, and within "
     "a few seasons the number of fish and dragonflies has begun to climb again."),

    ("The first mechanical clocks appeared in European towers in the late thirteenth century. They had no "
     "faces and no hands; instead, they struck a bell to mark the hours, and the townspeople counted the "
     "strokes. Their mechanism relied on a heavy weight that slowly descended, turning a series of gears, "
     "while a device called an escapement released the gears one tooth at a time. These clocks were not "
     "very accurate and could drift by a quarter of an hour each day, so a keeper had to climb the tower "
     "regularly and adjust them by the position of the sun."),

    ("Growing tomatoes on a balcony is possible even in a small city flat. The plants need at least six "
     "hours of direct sunlight, a deep pot filled with rich compost, and regular watering, especially in "
     "hot weather when the soil dries out within a day. Tall varieties should be tied to a cane as they "
     "grow, and the small shoots that appear between the main stem and the leaves can be pinched off to "
     "keep the plant tidy. By late summer, a single healthy plant can produce several kilograms of fruit, "
     "enough for salads, sauces and a few jars for the winter."),

    ("The night train left the capital a few minutes after eleven. In the narrow compartment, four strangers "
     "arranged their bags, exchanged polite nods and tried to decide who would take the upper bunks. An "
     "elderly man produced a thermos of tea and offered cups to everyone; a student with a violin case "
     "explained that she was travelling to an audition; and a quiet engineer admitted that he had taken the "
     "train simply because he was afraid of flying. By the time the lights of the suburbs had faded behind "
     "them, they were talking like old friends."),

    ("Honeybees communicate the location of food through a behaviour known as the waggle dance. A forager "
     "that has found a rich patch of flowers returns to the hive and runs a short straight line across the "
     "comb while shaking her body, then loops back and repeats the run. The angle of the straight run, "
     "relative to the vertical, tells the other bees the direction of the flowers relative to the sun, and "
     "the length of the run indicates the distance. Bees that follow the dance closely can then fly "
     "directly to the flowers, sometimes several kilometres away."),

    ("Before the invention of the printing press, every book in Europe had to be copied by hand. Scribes "
     "worked in monasteries and later in workshops in the growing cities, writing with quills on parchment "
     "made from animal skin. A single large Bible could take a team of scribes more than a year to "
     "complete, and illuminators added coloured initials and miniature paintings in gold and blue. Because "
     "each copy was unique, mistakes crept into the texts, and scholars today compare many manuscripts to "
     "reconstruct what an author originally wrote."),

    ("Mountain weather can change within an hour. A walker who sets out under a clear morning sky may meet "
     "fog, rain or even snow by the early afternoon, especially above the tree line. Sensible hikers carry "
     "a waterproof jacket, an extra warm layer, a map and enough food and water for the whole day, and "
     "they tell someone where they are going and when they expect to return. If the clouds close in, it is "
     "usually wiser to turn back than to push on toward the summit, because the mountain will still be "
     "there next week."),
]

SHORT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colours are",
    "Water boils at a temperature of",
    "To make a good cup of tea, first",
]
CODE_PROMPT = "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n    if n < 2:\n"


def prose(order: list[int]) -> str:
    return "\n\n".join(PARAGRAPHS[i] for i in order)


def cut_to_tokens(llm: llama_cpp.Llama, text: str, lowest: int, highest: int) -> str:
    """The longest prefix of ``text`` ending at a sentence end (else a word end) that tokenizes, with
    BOS, to ``lowest``–``highest`` tokens."""
    for mark in (". ", " "):
        ends = [i + 1 for i in range(len(text)) if text.startswith(mark, i)] + [len(text)]
        fitting = [e for e in ends if lowest <= len(ids_of(llm, text[:e].rstrip())) <= highest]
        if fitting:
            return text[: max(fitting)].rstrip()
    raise ValueError(f"no prefix of the text is {lowest}–{highest} tokens")


def ids_of(llm: llama_cpp.Llama, text: str, special: bool = False) -> list[int]:
    return llm.tokenize(text.encode(), add_bos=True, special=special)


def detokenize(llm: llama_cpp.Llama, ids: list[int]) -> str:
    """llama.cpp's own detokenizer (``llama_detokenize``: nothing removed, special tokens not
    rendered). llama-cpp-python's ``detokenize`` is not used: it reads pieces through a 32-byte
    buffer (Gemma has 48-byte tokens) and drops a space after BOS for SentencePiece's sake."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    array = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64 + 64 * len(ids)
    buffer = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, array, len(ids), buffer, size, False, False)
    if n < 0:
        raise RuntimeError(f"detokenize needs {-n} bytes")
    return buffer.raw[:n].decode("utf-8")


def top_two(llm: llama_cpp.Llama) -> tuple[int, int, float]:
    """The ids of the two highest logits of the last evaluated position, and their difference."""
    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)[: llm.n_vocab()]
    first = max(range(len(row)), key=row.__getitem__)
    best = row[first]
    row[first] = float("-inf")
    second = max(range(len(row)), key=row.__getitem__)
    return first, second, best - row[second]


def greedy(llm: llama_cpp.Llama, prompt: str) -> dict:
    ids = ids_of(llm, prompt)
    llm.reset()
    out, top1, top2, margins = [], [], [], []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        first, second, margin = top_two(llm)
        if first != token:
            raise RuntimeError(f"greedy sampled {token}, the highest logit is {first}")
        out.append(int(token))
        top1.append(first)
        top2.append(second)
        margins.append(round(margin, 5))
        if len(out) == NEW_TOKENS:
            break
    return {"prompt": prompt, "prompt_tokens": len(ids), "prompt_ids": ids, "greedy_ids": out,
            "top1_ids": top1, "top2_ids": top2, "margins": margins}


def prompts(llm: llama_cpp.Llama) -> list[str]:
    everything = list(range(len(PARAGRAPHS)))
    window = cut_to_tokens(llm, prose(everything[5:] + everything[:5]), 500, 505)
    medium = cut_to_tokens(llm, prose(everything[::-1]), 760, 800)
    long = cut_to_tokens(llm, prose(everything), 1500, 1600)
    return [*SHORT_PROMPTS, CODE_PROMPT, window, medium, long]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def main(gguf: str) -> None:
    path = Path(gguf)
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=N_CTX, n_threads=2, n_threads_batch=2, verbose=False)
    tokenized = []
    for text in TEXTS:
        plain, special = ids_of(llm, text), ids_of(llm, text, special=True)
        tokenized.append({"text": text, "ids": plain, "detokenized": detokenize(llm, plain),
                          "ids_special": special, "detokenized_special": detokenize(llm, special)})
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    end_of_generation = [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    runs = [greedy(llm, p) for p in prompts(llm)]
    if max(r["prompt_tokens"] for r in runs) + NEW_TOKENS > N_CTX:
        raise RuntimeError("a prompt and its new tokens do not fit the context")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "llama_cpp_python": llama_cpp.__version__, "gguf": path.name, "gguf_sha256": sha256(path),
        "tokenize_settings": {"ids": "add_bos=True, special=False", "ids_special": "add_bos=True, special=True",
                              "detokenized": "llama_detokenize(remove_special=False, unparse_special=False)"},
        "greedy_settings": {"tokenize": "add_bos=True, special=False", "top_k": 1, "temp": 0.0,
                            "repeat_penalty": 1.0, "n_threads": 2, "n_ctx": N_CTX, "new_tokens": NEW_TOKENS,
                            "eos": "ignored", "sliding_window": SLIDING_WINDOW},
        "end_of_generation_ids": end_of_generation, "tokenize": tokenized, "greedy": runs,
    }, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(OUT)


if __name__ == "__main__":
    main(sys.argv[1])
