import unittest

from stats import mean, spread


class StatsTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 6]), 3)

    def test_spread(self):
        self.assertEqual(spread([4, 1, 9]), 8)


if __name__ == "__main__":
    unittest.main()
