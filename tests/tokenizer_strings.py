"""Deterministic test strings for tokenizer parity tests (fixed cases plus seeded random mixes)."""

import random

FIXED = [
    # prose
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, isn't it? We'll see; they'd've known.",
    "SHOUTING CAPS DON'T STOP, WE'LL WIN, I'M SURE, YOU'RE RIGHT, THEY'VE GONE",
    "Mixed-case ThIs Is OdD, camelCaseIdentifier and snake_case_name",
    "Email me at someone@example.com or visit https://example.org/a/b?c=d&e=f#frag",
    "Ellipsis... em—dash – en-dash “curly quotes” ‘single’ «guillemets» ¿Qué? ¡Sí!",
    # whitespace
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\t",
    "a\tb\t\tc",
    "  leading spaces",
    "trailing spaces   ",
    "multiple   inner    spaces",
    "line one\nline two\n\nline four\n",
    "windows\r\nline\r\nendings\r\n",
    "lone\rcarriage",
    " \n \t \n  mixed whitespace  \t\n",
    "nbsp\u00a0here and\u2003em space and\u3000ideographic space",
    "zero\u200bwidth\u200cnon\u200djoiner",
    # code
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "if __name__ == \"__main__\":\n\tmain()\n",
    "const re = /^[a-z0-9_-]{3,16}$/i; // regex",
    "<div class=\"c\">&amp; &lt;tag&gt;</div>",
    "SELECT * FROM t WHERE id IN (1, 2, 3) ORDER BY name DESC;",
    "{\"key\": [1, 2.5, -3e10, null, true], \"nested\": {\"a\": \"b\"}}",
    "    indented\n        more\n            most",
    "#!/bin/bash\necho \"$HOME\" | grep -E '^/[a-z]+' && exit 0",
    # numbers
    "12345",
    "1234567890123456789",
    "3.14159 2.71828 -42 +7 1e-9 0x1F 0b1010",
    "Dates: 2024-05-17, 17/05/2024, 12:34:56.789",
    "$1,234,567.89 and €99 and ¥1000 and 50%",
    "superscripts x² y³ fractions ½ ¾ roman Ⅻ",
    "Arabic-Indic ١٢٣٤٥ Devanagari १२३ fullwidth １２３",
    # CJK
    "日本語のテキストです。",
    "中文文本测试，包括标点符号！",
    "한국어 텍스트도 있습니다.",
    "混合 mixed 文本 text 123 漢字",
    "ｆｕｌｌｗｉｄｔｈ　ｌａｔｉｎ",
    # emoji
    "emoji 😀😃😄 end",
    "family 👨‍👩‍👧‍👦 and couple 👩‍❤️‍💋‍👨",
    "flags 🇺🇸🇯🇵🇫🇷 and keycap 1️⃣ #️⃣",
    "skin tones 👍🏻👍🏿 and 🏳️‍🌈",
    "🤖",
    "text🙂text🙃text",
    # combining marks
    "cafe\u0301 vs café",
    "Z\u0351\u0352a\u0353l\u0354g\u0355o\u0356",
    "e\u0301\u0302\u0303\u0304",
    "Ångström naïve façade coöperate",
    "Vietnamese: Tiếng Việt có dấu",
    # RTL and other scripts
    "مرحبا بالعالم",
    "שלום עולם",
    "mixed LTR עברית RTL العربية text",
    "Русский текст, Ελληνικά, Українська",
    "हिन्दी पाठ और தமிழ் உரை",
    "ภาษาไทยไม่มีช่องว่าง",
    "Ge'ez: ሰላም ዓለም",
    # specials embedded
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    " <|im_start|> spaced <|im_end|> ",
    "<|im_start|>",
    "<|im_start",
    "<|notaspecial|>",
    "<s>hi</s> there",
    "hi<s>there</s>",
    # odd characters
    "\u0000 nul and \u0007 bell and \u001b[31m ansi",
    "\ufeffBOM at start",
    "replacement char \ufffd literal",
    "private use \ue000 and astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "math ∀x∈ℝ: x²≥0 ⇒ √x ∈ ℝ⁺ ∪ {0}",
    "box ┌─┐│ │└─┘ and braille ⠓⠑⠇⠇⠕",
]

_POOL = [
    "hello", "World", " the", "don't", "I'M", "x", "42", "3.14", "0000", "\n", "\n\n", "\t", "  ", "   ",
    "é", "e\u0301", "ß", "日本", "語", "中文", "한국", "😀", "👨\u200d👩\u200d👧", "🇺🇸", "👍🏽", "مرحبا", "שלום",
    "Привет", "def", "()", "{}", "[]", "->", "=>", "//", "#", "$", "%", "...", "—", "’", "«»", "\r\n", "\u00a0",
    "ⅫⅣ", "½", "١٢٣", "１２", "\u200d", "\ufe0f", "ก", "ไทย", "ሰላም", "𝔘", "\u0300", "'s", "'LL", "ALLCAPS",
    "camelCase",
]
_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
_SEPARATORS = ["", "", " ", " ", "\n", "\t", "  "]


def random_mixes(n: int, seed: int, specials=_SPECIALS) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            frag = rng.choice(specials) if specials and rng.random() < 0.08 else rng.choice(_POOL)
            parts.append(frag + rng.choice(_SEPARATORS))
        out.append("".join(parts))
    return out


def parity_strings() -> list[str]:
    return FIXED + random_mixes(240, seed=20240517)
