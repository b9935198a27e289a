"""``python -m sglang_ext.eval --url URL``: what each KV policy a server offers costs in answers,
task by task and length by length, against full attention on the same server.

Tasks in the style of RULER are generated locally from a seed and sized to exact token lengths
with the server's own tokenizer (``tasks``); each case runs greedily under every chosen policy and
under full attention (``runner``, over ``client``); answers are scored (``scoring``), finished
runs kept for a resumed run (``store``), and the result written as benchmark rows, a Markdown
table and a plot (``report``). How to run and read it: docs/eval.md.
"""
