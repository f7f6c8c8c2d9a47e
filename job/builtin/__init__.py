"""What the project builds to run without downloads: its own tiny models (tiny_model.py, from corpus.py,
tokenizer.py, architectures.py and training.py, over data/corpus.txt and data/chat_template.jinja) and the embedded
demo (demo.py).
"""
