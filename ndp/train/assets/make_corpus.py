"""Regenerate corpus.txt: original English prose from a small seeded grammar (no downloads).

    python ndp/train/assets/make_corpus.py  # writes corpus.txt next to this file (~300 KB)
"""
import os
import random

PLACES = ["the harbour town", "a valley of orchards", "the old observatory", "a village by the river",
          "the northern pass", "a lighthouse on the cape", "the market square", "a farm at the edge of the moor",
          "the university library", "a workshop under the bridge", "the salt marshes", "a quiet railway station"]
PEOPLE = ["a clockmaker", "the ferryman", "an old teacher", "a young engineer", "the baker's daughter",
          "a travelling musician", "the keeper of the light", "a retired sailor", "two brothers",
          "the village doctor", "a surveyor from the city", "a girl who collected maps"]
THINGS = ["a brass compass", "a box of letters", "an unfinished map", "a broken telescope", "a jar of seeds",
          "a ledger of tides", "a wooden boat", "a lantern with green glass", "a notebook of songs",
          "a key with no lock", "a copper kettle", "a drawing of the stars"]
VERBS = ["found", "repaired", "carried", "studied", "lost", "traded", "painted", "measured", "hid", "remembered",
         "described", "polished"]
ADJ = ["patient", "curious", "tired", "cheerful", "careful", "stubborn", "gentle", "restless", "quiet", "proud"]
WEATHER = ["The rain came in from the sea", "A cold wind moved over the hills", "The morning was clear and bright",
           "Fog lay on the water until noon", "Snow fell softly through the night",
           "The summer heat made the roads dusty", "Clouds gathered slowly in the west"]
TIME = ["In the spring", "Late one evening", "Every winter", "On the first day of the fair", "Years later",
        "Before dawn", "After the long harvest", "During the storm"]
REFLECT = ["Nobody could say why it mattered so much, but it did.",
           "It was the kind of work that rewards a steady hand and an honest eye.",
           "Small things, kept with care, often outlast the people who made them.",
           "The town talked about it for weeks and then, as towns do, forgot.",
           "Some questions are answered only by walking the same road many times.",
           "Patience, they said, is a tool like any other and must be sharpened.",
           "What is measured carefully can be trusted; what is guessed must be checked.",
           "The lesson was simple: count twice, cut once, and write everything down."]
NUM = ["three", "seven", "twelve", "forty", "a hundred", "two", "nine", "eleven"]


def sentence(r):
    kind = r.randrange(6)
    if kind == 0:
        return f"{r.choice(TIME)}, {r.choice(PEOPLE)} {r.choice(VERBS)} {r.choice(THINGS)} near {r.choice(PLACES)}."
    if kind == 1:
        return f"{r.choice(WEATHER)}, and {r.choice(PEOPLE)} stayed indoors with {r.choice(THINGS)}."
    if kind == 2:
        p = r.choice(PEOPLE)
        return (f"{p[0].upper() + p[1:]} was {r.choice(ADJ)} and {r.choice(ADJ)}, and had walked "
                f"{r.choice(NUM)} miles to reach {r.choice(PLACES)}.")
    if kind == 3:
        return r.choice(REFLECT)
    if kind == 4:
        return (f"\"We will need {r.choice(THINGS)} before the week is out,\" said {r.choice(PEOPLE)}, "
                f"looking toward {r.choice(PLACES)}.")
    return (f"For {r.choice(NUM)} days the {r.choice(ADJ)} traveller {r.choice(VERBS)} "
            f"{r.choice(THINGS)}, until the light changed over {r.choice(PLACES)}.")


def main(size=300_000, seed=1234):
    r = random.Random(seed)
    paras, total = [], 0
    while total < size:
        p = " ".join(sentence(r) for _ in range(r.randint(3, 9)))
        paras.append(p)
        total += len(p) + 2
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n\n".join(paras) + "\n")
    return out


if __name__ == "__main__":
    print(main())
