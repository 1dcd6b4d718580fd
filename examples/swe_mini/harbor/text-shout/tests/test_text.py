import unittest

from text import shout, whisper


class TextTest(unittest.TestCase):
    def test_shout(self):
        self.assertEqual(shout("hello"), "HELLO!")

    def test_whisper(self):
        self.assertEqual(whisper("Hello"), "hello...")


if __name__ == "__main__":
    unittest.main()
