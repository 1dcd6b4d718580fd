"""Text helpers."""


def shout(text):
    return text.lower() + "!"


def whisper(text):
    return text.lower() + "..."
