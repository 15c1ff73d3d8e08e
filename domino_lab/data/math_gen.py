"""Seeded generator of GSM8K-style grade-school word problems.

Each problem is a short story with a few people and quantities; the solution walks through 2-6
arithmetic steps, each with an inline `<<expr=value>>` calculation, and ends with `#### answer`.
All intermediate results are non-negative integers (divisions are built from their quotient, so
they are always exact).

Determinism: `generate_problem(seed)` seeds `random.Random` with a string (hashed with SHA-512 by
the standard library), which is stable across Python versions and platforms.

Train / held-out disjointness is guaranteed *by question text*, not just by seed: every question
is assigned a bucket from a hash of its text, train seeds only ever return train-bucket
questions and held-out seeds only held-out-bucket ones (rejected draws are redrawn). Two seeds
that happen to produce the same numbers and names therefore can never straddle the split.
"""
from __future__ import annotations

import hashlib
import random
from typing import Callable

# Bump whenever the output for any seed changes: it keys the on-disk cache and the held-out set.
GENERATOR_VERSION = "2"

MATH_TRAIN_SEEDS = range(0, 10**9)
MATH_HELDOUT_SEEDS = range(10**9, 2 * 10**9)


class _Redraw(Exception):
    """A template's random numbers broke a constraint (e.g. negative stock); draw again."""


# ----------------------------------------------------------------------------- vocabulary

_NAMES = [
    ("Aisha", "she"), ("Ben", "he"), ("Carlos", "he"), ("Dana", "she"), ("Elena", "she"),
    ("Farid", "he"), ("Grace", "she"), ("Hiro", "he"), ("Ines", "she"), ("Jamal", "he"),
    ("Keiko", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Olga", "she"),
    ("Pedro", "he"), ("Quinn", "she"), ("Rosa", "she"), ("Sam", "he"), ("Tara", "she"),
    ("Umar", "he"), ("Vera", "she"), ("Wes", "he"), ("Ximena", "she"), ("Yusuf", "he"),
    ("Zoe", "she"), ("Amir", "he"), ("Bella", "she"), ("Chen", "he"), ("Divya", "she"),
    ("Emil", "he"), ("Fatima", "she"), ("Gabe", "he"), ("Hana", "she"), ("Ivan", "he"),
    ("Julia", "she"), ("Kofi", "he"), ("Lena", "she"), ("Marco", "he"), ("Nadia", "she"),
    ("Oscar", "he"), ("Priya", "she"), ("Raj", "he"), ("Sofia", "she"), ("Tomas", "he"),
    ("Uma", "she"), ("Victor", "he"), ("Wendy", "she"), ("Yara", "she"), ("Zane", "he"),
    ("Mr. Lopez", "he"), ("Mrs. Park", "she"), ("Ms. Novak", "she"), ("Mr. Okafor", "he"),
]

# (plural, singular) collectible things for inventory stories
_ITEMS = [
    ("marbles", "marble"), ("stickers", "sticker"), ("stamps", "stamp"), ("trading cards", "trading card"),
    ("seashells", "seashell"), ("beads", "bead"), ("comic books", "comic book"), ("pencils", "pencil"),
    ("toy cars", "toy car"), ("crayons", "crayon"), ("buttons", "button"), ("postcards", "postcard"),
    ("rubber bands", "rubber band"), ("coins", "coin"), ("feathers", "feather"), ("keychains", "keychain"),
    ("paper cranes", "paper crane"), ("baseball cards", "baseball card"), ("pebbles", "pebble"),
    ("glass beads", "glass bead"), ("erasers", "eraser"), ("puzzle pieces", "puzzle piece"),
]

# (plural, container) goods sold or packed in containers
_GOODS = [
    ("apples", "bag"), ("oranges", "crate"), ("eggs", "carton"), ("cookies", "tin"), ("muffins", "box"),
    ("cupcakes", "tray"), ("pencils", "pack"), ("markers", "set"), ("tennis balls", "can"),
    ("batteries", "pack"), ("bottles of water", "case"), ("juice boxes", "pack"), ("candles", "box"),
    ("bagels", "bag"), ("tomatoes", "basket"), ("peaches", "crate"), ("lemons", "bag"), ("rolls", "bag"),
    ("donuts", "box"), ("plums", "basket"),
]

# (plural item, price range) for shopping
_SHOP = [
    ("notebooks", (2, 9)), ("pens", (1, 5)), ("shirts", (8, 30)), ("books", (5, 25)), ("hats", (6, 20)),
    ("sandwiches", (3, 9)), ("toys", (4, 18)), ("plants", (3, 15)), ("mugs", (4, 12)),
    ("socks", (2, 7)), ("candles", (2, 10)), ("puzzles", (6, 22)), ("scarves", (7, 25)),
    ("water bottles", (3, 14)), ("board games", (12, 40)), ("tickets", (5, 20)), ("pizzas", (8, 16)),
    ("bags of chips", (1, 4)), ("flowers", (1, 6)), ("lamps", (15, 45)),
]

_PLACES = ["the market", "the fair", "the bakery", "the school sale", "the corner shop", "the mall",
           "the farm stand", "the bookstore", "the garage sale", "the craft store", "the toy shop"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_FRACTIONS = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth", 10: "a tenth"}
_TIMES = {2: "twice", 3: "three times", 4: "four times", 5: "five times", 6: "six times"}


def _apply(a: int, sym: str, b: int) -> int:
    if sym == "+":
        return a + b
    if sym == "-":
        if b > a:
            raise _Redraw
        return a - b
    if sym == "*":
        return a * b
    if sym == "/":
        if b == 0 or a % b:
            raise _Redraw
        return a // b
    raise ValueError(sym)


class _Solution:
    """Accumulates solution lines; each `step` does one checked calculation."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def step(self, a: int, sym: str, b: int, sentence: str) -> int:
        c = _apply(a, sym, b)
        if c > 10**7:  # grade-school scale; also keeps token counts small
            raise _Redraw
        expr = f"{a}{sym}{b}"
        self.lines.append(sentence.format(calc=f"{expr} = <<{expr}={c}>>{c}"))
        return c


def _person(rng: random.Random, exclude: tuple = ()) -> tuple[str, str, str]:
    """(name, subject pronoun, possessive pronoun)"""
    name, he = rng.choice([n for n in _NAMES if n[0] not in exclude])
    return name, he, "his" if he == "he" else "her"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _divisors(n: int, lo: int = 2, hi: int = 10) -> list[int]:
    return [d for d in range(lo, hi + 1) if n % d == 0 and d < n]


# ----------------------------------------------------------------------------- templates
# Each template returns (question, solution lines, answer).

def _t_collection(rng: random.Random):
    """A running count of a collection changed by a chain of 1-4 events."""
    name, he, his = _person(rng)
    friend, _, _ = _person(rng, (name,))
    items, _ = rng.choice(_ITEMS)
    x = rng.randint(8, 90)
    q = [rng.choice([f"{name} has {x} {items}.", f"{name} owns {x} {items}.",
                     f"{name} starts the week with {x} {items}.", f"There are {x} {items} in {name}'s box."])]
    sol = _Solution()
    events = rng.randint(1, 4)
    for day in rng.sample(_DAYS, events) if rng.random() < 0.5 else [None] * events:
        when = f"On {day}, " if day else rng.choice(["Then ", "Later, ", "Next, ", "After that, "])
        kind = rng.choice(["gain", "lose", "packs", "times", "split", "fraction"])
        if kind == "gain":
            k = rng.randint(3, 60)
            q.append(when + rng.choice([f"{he} buys {k} more.", f"{friend} gives {name} {k} {items}.",
                                        f"{he} finds {k} more {items}.", f"{he} wins {k} {items} in a game."]))
            x = sol.step(x, "+", k, f"{_cap(he)} then has {{calc}} {items}.")
        elif kind == "lose":
            k = rng.randint(2, max(2, x - 1))
            q.append(when + rng.choice([f"{he} gives {k} of them to {friend}.", f"{he} loses {k} {items}.",
                                        f"{he} trades away {k} {items}.", f"{he} sells {k} {items} to {friend}."]))
            x = sol.step(x, "-", k, f"{_cap(he)} has {{calc}} {items} left.")
        elif kind == "packs":
            p, m = rng.randint(2, 7), rng.randint(3, 12)
            q.append(when + rng.choice([f"{he} buys {p} packs with {m} {items} in each pack.",
                                        f"{he} gets {p} bags of {items}, each holding {m}."]))
            got = sol.step(p, "*", m, f"The packs hold {{calc}} {items}.")
            x = sol.step(x, "+", got, f"Now {he} has {{calc}} {items}.")
        elif kind == "times":
            t = rng.choice([2, 3])
            q.append(when + rng.choice([f"{he} manages to {'double' if t == 2 else 'triple'} {his} collection.",
                                        f"{his} collection grows to {_TIMES[t]} its size."]))
            x = sol.step(x, "*", t, f"The collection becomes {{calc}} {items}.")
        elif kind == "split":
            ds = _divisors(x, 2, 8)
            if not ds:
                raise _Redraw
            k = rng.choice(ds)
            q.append(when + f"{he} sorts the {items} equally into {k} boxes and keeps only one box.")
            x = sol.step(x, "/", k, f"One box holds {{calc}} {items}.")
        else:
            ds = [d for d in _FRACTIONS if x % d == 0 and d < x]
            if not ds:
                raise _Redraw
            d = rng.choice(ds)
            q.append(when + rng.choice([f"{he} gives {_FRACTIONS[d]} of {his} {items} to {friend}.",
                                        f"{he} donates {_FRACTIONS[d]} of them to a school."]))
            g = sol.step(x, "/", d, f"{_cap(he)} gives away {{calc}} {items}.")
            x = sol.step(x, "-", g, f"{_cap(he)} keeps {{calc}} {items}.")
        if len(sol.lines) > 6:
            raise _Redraw
    if len(sol.lines) < 2:
        raise _Redraw
    q.append(rng.choice([f"How many {items} does {name} have now?", f"How many {items} does {name} end up with?",
                         f"How many {items} are left in the end?"]))
    return q, sol.lines, x


def _t_shopping_change(rng: random.Random):
    name, he, his = _person(rng)
    (a_item, (lo1, hi1)), (b_item, (lo2, hi2)) = rng.sample(_SHOP, 2)
    na, pa = rng.randint(2, 6), rng.randint(lo1, hi1)
    nb, pb = rng.randint(2, 5), rng.randint(lo2, hi2)  # >= 2 so the plural item names read right
    place = rng.choice(_PLACES)
    sol = _Solution()
    ca = sol.step(na, "*", pa, f"The {a_item} cost {{calc}} dollars.")
    cb = sol.step(nb, "*", pb, f"The {b_item} cost {{calc}} dollars.")
    total = sol.step(ca, "+", cb, "Altogether that is {calc} dollars.")
    q = [rng.choice([f"{name} goes to {place} and buys {na} {a_item} for ${pa} each and {nb} {b_item} for ${pb} each.",
                     f"At {place}, {name} picks up {na} {a_item} that cost ${pa} apiece and {nb} {b_item} at ${pb} each."])]
    if rng.random() < 0.6:
        bill = rng.choice([b for b in (20, 50, 100, 200, 500) if b >= total] or [None])
        if bill is None:
            raise _Redraw
        q.append(rng.choice([f"{_cap(he)} pays with a ${bill} bill. How much change does {he} get?",
                             f"If {he} hands the cashier ${bill}, how many dollars does {he} get back?"]))
        ans = sol.step(bill, "-", total, f"The change is {{calc}} dollars.")
    else:
        q.append(rng.choice([f"How much does {he} spend in total?", f"How many dollars does {name} pay altogether?"]))
        ans = total
    return q, sol.lines, ans


def _t_compare_people(rng: random.Random):
    a, _, _ = _person(rng)
    b, _, _ = _person(rng, (a,))
    c, _, _ = _person(rng, (a, b))
    items, _ = rng.choice(_ITEMS + [(g, "") for g, _ in _GOODS])
    x = rng.randint(4, 40)
    t = rng.choice(list(_TIMES))
    k = rng.randint(2, 15)
    sol = _Solution()
    q = [f"{a} has {x} {items}.", rng.choice([f"{b} has {_TIMES[t]} as many {items} as {a}.",
                                               f"{b} has {_TIMES[t]} the number of {items} that {a} has."])]
    y = sol.step(x, "*", t, f"{b} has {{calc}} {items}.")
    if rng.random() < 0.5:
        q.append(f"{c} has {k} fewer {items} than {b}.")
        z = sol.step(y, "-", k, f"{c} has {{calc}} {items}.")
    else:
        q.append(f"{c} has {k} more {items} than {b}.")
        z = sol.step(y, "+", k, f"{c} has {{calc}} {items}.")
    style = rng.random()
    if style < 0.5:
        q.append(f"How many {items} do the three of them have together?")
        s = sol.step(x, "+", y, f"{a} and {b} have {{calc}} {items} together.")
        ans = sol.step(s, "+", z, f"All three have {{calc}} {items}.")
    elif style < 0.75:
        q.append(f"How many more {items} does {c} have than {a}?")
        ans = sol.step(z, "-", x, f"{c} has {{calc}} more {items} than {a}.")
    else:
        q.append(f"How many {items} do {a} and {c} have combined?")
        ans = sol.step(x, "+", z, f"Together they have {{calc}} {items}.")
    return q, sol.lines, ans


def _t_wages(rng: random.Random):
    name, he, his = _person(rng)
    job = rng.choice(["babysitter", "dog walker", "tutor", "cashier", "lifeguard", "gardener", "barista",
                      "delivery driver", "painter", "library assistant"])
    rate, hours, days = rng.randint(8, 25), rng.randint(2, 8), rng.randint(2, 6)
    sol = _Solution()
    q = [rng.choice([f"{name} works as a {job} and earns ${rate} per hour.",
                     f"{name} is paid ${rate} an hour as a {job}."]),
         rng.choice([f"{_cap(he)} works {hours} hours a day for {days} days.",
                     f"This week {he} works {days} days, {hours} hours each day."])]
    per_day = sol.step(rate, "*", hours, f"Each day {he} earns {{calc}} dollars.")
    earned = sol.step(per_day, "*", days, f"Over {days} days {he} earns {{calc}} dollars.")
    r = rng.random()
    if r < 0.35:
        bonus = rng.randint(5, 60)
        spend = rng.randint(10, earned)
        q.append(f"{_cap(he)} also gets a ${bonus} tip, then spends ${spend} on {rng.choice(['groceries', 'a gift', 'books', 'shoes', 'a concert ticket'])}.")
        tot = sol.step(earned, "+", bonus, "With the tip that is {calc} dollars.")
        ans = sol.step(tot, "-", spend, "After spending, " + he + " has {calc} dollars left.")
        q.append(f"How much money does {he} have left?")
    elif r < 0.7:
        d = rng.choice([d for d in (2, 3, 4, 5) if earned % d == 0] or [None])
        if d is None:
            raise _Redraw
        q.append(f"{_cap(he)} saves {_FRACTIONS[d]} of {his} earnings. How many dollars does {he} save?")
        ans = sol.step(earned, "/", d, f"{_cap(he)} saves {{calc}} dollars.")
    else:
        q.append(f"How much does {name} earn in total?")
        ans = earned
    return q, sol.lines, ans


def _t_savings_goal(rng: random.Random):
    name, he, his = _person(rng)
    thing = rng.choice(["a bike", "a guitar", "a tablet", "a pair of skates", "a telescope", "a video game console",
                        "a camera", "a tent", "a keyboard", "a drone"])
    weekly = rng.randint(4, 30)
    weeks = rng.randint(3, 20)
    have = rng.randint(0, 120)
    gift = rng.randint(5, 50) if rng.random() < 0.5 else 0
    price = have + gift + weekly * weeks
    sol = _Solution()
    q = [f"{name} wants to buy {thing} that costs ${price}.", f"{_cap(he)} already has ${have} saved."]
    cur = have
    if gift:
        q.append(f"{his.capitalize()} {rng.choice(['grandmother', 'uncle', 'aunt', 'grandfather', 'neighbor'])} gives {name} ${gift}.")
        cur = sol.step(have, "+", gift, f"After the gift {he} has {{calc}} dollars.")
    q.append(rng.choice([f"If {he} saves ${weekly} every week, how many weeks will it take to have enough money?",
                         f"{_cap(he)} puts away ${weekly} each week. How many weeks until {he} can buy it?"]))
    need = sol.step(price, "-", cur, f"{_cap(he)} still needs {{calc}} dollars.")
    ans = sol.step(need, "/", weekly, f"It will take {{calc}} weeks.")
    return q, sol.lines, ans


def _t_travel(rng: random.Random):
    name, he, his = _person(rng)
    vehicle = rng.choice(["drives", "rides a bus", "cycles", "takes a train", "sails"])
    s1, h1 = rng.randint(10, 70), rng.randint(1, 5)
    s2, h2 = rng.randint(10, 70), rng.randint(2, 4)
    sol = _Solution()
    q = [f"{name} {vehicle} at {s1} miles per hour for {h1} hours.",
         rng.choice([f"Then {he} goes {s2} miles per hour for {h2} more hours.",
                     f"After a break, {he} travels at {s2} miles per hour for {h2} hours."])]
    d1 = sol.step(s1, "*", h1, f"The first part covers {{calc}} miles.")
    d2 = sol.step(s2, "*", h2, f"The second part covers {{calc}} miles.")
    tot = sol.step(d1, "+", d2, "In total that is {calc} miles.")
    if rng.random() < 0.4:
        trip = tot + rng.randint(5, 200)
        q.append(f"The whole trip is {trip} miles long. How many miles are left?")
        ans = sol.step(trip, "-", tot, "There are {calc} miles left.")
    elif rng.random() < 0.5 and (h1 + h2) > 1:
        hrs = h1 + h2
        if tot % hrs:
            raise _Redraw
        q.append("What was the average speed for the whole trip in miles per hour?")
        t = sol.step(h1, "+", h2, "The trip took {calc} hours.")
        ans = sol.step(tot, "/", t, "The average speed is {calc} miles per hour.")
    else:
        q.append(f"How many miles does {name} travel in total?")
        ans = tot
    return q, sol.lines, ans


def _t_ages(rng: random.Random):
    a, _, _ = _person(rng)
    b, _, _ = _person(rng, (a,))
    c, _, _ = _person(rng, (a, b))
    x = rng.randint(4, 30)
    k = rng.randint(2, 20)
    years = rng.randint(2, 15)
    sol = _Solution()
    q = [f"{a} is {x} years old.", f"{b} is {k} years older than {a}."]
    y = sol.step(x, "+", k, f"{b} is {{calc}} years old.")
    if y % 2 == 0 and rng.random() < 0.5:
        q.append(f"{c} is half as old as {b}.")
        z = sol.step(y, "/", 2, f"{c} is {{calc}} years old.")
    else:
        m = rng.randint(1, 3)
        if m == 1:
            q.append(f"{c} is the same age as {b}.")
            z = y
        else:
            q.append(f"{c} is {_TIMES[m]} as old as {b}.")
            z = sol.step(y, "*", m, f"{c} is {{calc}} years old.")
    q.append(rng.choice([f"What will be the sum of their three ages in {years} years?",
                         f"In {years} years, how old will {c} be?"]))
    if q[-1].startswith("What"):
        now = sol.step(x, "+", y, f"{a} and {b} are {{calc}} years together.")
        now = sol.step(now, "+", z, "The three ages add up to {calc} now.")
        add = sol.step(3, "*", years, "Each of the three gets " + str(years) + " years older, adding {calc} years.")
        ans = sol.step(now, "+", add, "The sum will be {calc}.")
    else:
        ans = sol.step(z, "+", years, f"{c} will be {{calc}} years old.")
    if len(sol.lines) < 2:
        raise _Redraw
    return q, sol.lines, ans


def _t_recipe(rng: random.Random):
    name, he, his = _person(rng)
    food = rng.choice(["cookies", "pancakes", "muffins", "biscuits", "waffles", "brownies", "dumplings", "tarts"])
    ingr, unit = rng.choice([("flour", "cups"), ("sugar", "spoons"), ("milk", "cups"), ("butter", "tablespoons"),
                             ("oats", "scoops"), ("eggs", "eggs")])
    base = rng.choice([6, 8, 10, 12, 15, 20, 24])
    amt = rng.randint(2, 6)
    mult = rng.randint(2, 6)
    want = base * mult
    sol = _Solution()
    q = [f"A recipe for {base} {food} needs {amt} {unit} of {ingr}." if ingr != "eggs" else
         f"A recipe for {base} {food} needs {amt} eggs.",
         rng.choice([f"{name} wants to make {want} {food}.", f"{name} is baking {want} {food} for a party."])]
    batches = sol.step(want, "/", base, f"{_cap(he)} needs {{calc}} batches.")
    need = sol.step(batches, "*", amt, f"That takes {{calc}} {unit}.")
    if rng.random() < 0.5:
        have = rng.randint(0, need)
        q.append(f"{_cap(he)} has {have} {unit} at home. How many more {unit} does {he} need?")
        ans = sol.step(need, "-", have, f"{_cap(he)} needs {{calc}} more {unit}.")
    else:
        q.append(f"How many {unit} {'of ' + ingr + ' ' if ingr != 'eggs' else ''}does {he} need?")
        ans = need
    return q, sol.lines, ans


def _t_garden(rng: random.Random):
    name, he, his = _person(rng)
    plant = rng.choice(["tomato plants", "rose bushes", "carrots", "sunflowers", "pepper plants", "tulips",
                        "lettuce heads", "bean plants", "strawberry plants"])
    rows, per = rng.randint(3, 12), rng.randint(4, 15)
    sol = _Solution()
    q = [rng.choice([f"{name} plants {rows} rows of {plant} with {per} in each row.",
                     f"{name}'s garden has {rows} rows, and each row has {per} {plant}."])]
    tot = sol.step(rows, "*", per, f"There are {{calc}} {plant}.")
    d = rng.choice([d for d in _FRACTIONS if tot % d == 0 and d < tot] or [None])
    if d is None:
        raise _Redraw
    q.append(rng.choice([f"Rabbits eat {_FRACTIONS[d]} of them.", f"{_cap(_FRACTIONS[d])} of them die in a frost."]))
    lost = sol.step(tot, "/", d, f"{{calc}} {plant} are lost.")
    left = sol.step(tot, "-", lost, f"{{calc}} {plant} remain.")
    if rng.random() < 0.5:
        new = rng.randint(3, 30)
        q.append(f"{_cap(he)} then plants {new} new ones. How many {plant} are there now?")
        ans = sol.step(left, "+", new, f"Now there are {{calc}} {plant}.")
    else:
        q.append(f"How many {plant} are left?")
        ans = left
    return q, sol.lines, ans


def _t_reading(rng: random.Random):
    name, he, his = _person(rng)
    per_day, days = rng.randint(5, 40), rng.randint(2, 9)
    sol = _Solution()
    read = per_day * days
    book = read + rng.randint(10, 300)
    q = [f"{name}'s book has {book} pages.",
         rng.choice([f"{_cap(he)} reads {per_day} pages every day for {days} days.",
                     f"For {days} days, {he} reads {per_day} pages a day."])]
    r = sol.step(per_day, "*", days, f"{_cap(he)} reads {{calc}} pages.")
    left = sol.step(book, "-", r, "There are {calc} pages left.")
    if left % 2 == 0 and rng.random() < 0.5:
        q.append(f"The next day {he} reads half of the remaining pages. How many pages are still unread?")
        half = sol.step(left, "/", 2, f"{_cap(he)} reads {{calc}} pages the next day.")
        ans = sol.step(left, "-", half, "{calc} pages are still unread.")
    else:
        q.append(rng.choice([f"How many pages does {he} have left to read?", "How many pages remain?"]))
        ans = left
    return q, sol.lines, ans


def _t_bakery(rng: random.Random):
    name, he, his = _person(rng)
    shop = rng.choice(["bakery", "lemonade stand", "food truck", "cafe", "flower stall", "bookshop"])
    (a, pa), (b, pb) = [(g, rng.randint(1, 6)) for g, _ in rng.sample(_GOODS, 2)]
    na, nb = rng.randint(5, 60), rng.randint(5, 60)
    sol = _Solution()
    q = [f"{name}'s {shop} sells {a} for ${pa} each and {b} for ${pb} each.",
         rng.choice([f"Today it sold {na} {a} and {nb} {b}.", f"On {rng.choice(_DAYS)} it sold {na} {a} and {nb} {b}."])]
    ra = sol.step(na, "*", pa, f"The {a} brought in {{calc}} dollars.")
    rb = sol.step(nb, "*", pb, f"The {b} brought in {{calc}} dollars.")
    rev = sol.step(ra, "+", rb, "Total sales were {calc} dollars.")
    if rng.random() < 0.6:
        cost = rng.randint(5, rev)
        q.append(f"The ingredients and supplies cost ${cost}. How much profit did the {shop} make?")
        ans = sol.step(rev, "-", cost, "The profit was {calc} dollars.")
    else:
        q.append(f"How much money did the {shop} make?")
        ans = rev
    return q, sol.lines, ans


def _t_tickets(rng: random.Random):
    name, he, his = _person(rng)
    event = rng.choice(["the zoo", "a museum", "the aquarium", "a movie", "a concert", "the water park",
                        "a baseball game", "the science center"])
    adults, kids = rng.randint(1, 4), rng.randint(1, 6)
    pa, pk = rng.randint(8, 40), rng.randint(3, 20)
    sol = _Solution()
    q = [f"Tickets to {event} cost ${pa} for adults and ${pk} for children.",
         f"{name} takes {adults} adult{'s' if adults > 1 else ''} and {kids} child{'ren' if kids > 1 else ''} in total."]
    ca = sol.step(adults, "*", pa, "Adult tickets cost {calc} dollars.")
    ck = sol.step(kids, "*", pk, "Children's tickets cost {calc} dollars.")
    tot = sol.step(ca, "+", ck, "The tickets cost {calc} dollars.")
    if rng.random() < 0.5:
        snack = rng.randint(2, 8)
        people = adults + kids
        q.append(f"Each person also buys a snack for ${snack}. How much does the trip cost?")
        n = sol.step(adults, "+", kids, "There are {calc} people.")
        s = sol.step(n, "*", snack, "Snacks cost {calc} dollars.")
        ans = sol.step(tot, "+", s, "The trip costs {calc} dollars.")
        assert n == people
    else:
        q.append("How much do the tickets cost altogether?")
        ans = tot
    return q, sol.lines, ans


def _t_party(rng: random.Random):
    name, he, his = _person(rng)
    guests = rng.randint(6, 40)
    each = rng.randint(1, 5)
    thing, pack = rng.choice([("balloons", "bag"), ("cupcakes", "box"), ("party hats", "pack"), ("juice boxes", "pack"),
                              ("cookies", "tin"), ("stickers", "sheet"), ("candles", "box")])
    per_pack = rng.randint(3, 12)
    need = guests * each
    if need % per_pack:
        raise _Redraw
    sol = _Solution()
    q = [f"{name} is having a party with {guests} guests.",
         f"{_cap(he)} wants to give each guest {each} {thing}.",
         f"{_cap(thing)} come in {pack}s of {per_pack}."]
    n = sol.step(guests, "*", each, f"{_cap(he)} needs {{calc}} {thing}.")
    packs = sol.step(n, "/", per_pack, f"That is {{calc}} {pack}s.")
    if rng.random() < 0.6:
        price = rng.randint(2, 9)
        q.append(f"Each {pack} costs ${price}. How much will {he} spend?")
        ans = sol.step(packs, "*", price, f"{_cap(he)} spends {{calc}} dollars.")
    else:
        q.append(f"How many {pack}s should {he} buy?")
        ans = packs
    return q, sol.lines, ans


def _t_exercise(rng: random.Random):
    name, he, his = _person(rng)
    act, unit = rng.choice([("runs", "kilometers"), ("swims", "laps"), ("walks", "miles"), ("cycles", "kilometers"),
                            ("does", "push-ups"), ("skips", "rope jumps")])
    wd, we = rng.randint(2, 12), rng.randint(2, 20)
    weeks = rng.randint(2, 6)
    sol = _Solution()
    obj = unit if act != "does" else unit
    q = [f"{name} {act} {wd} {obj} on each weekday and {we} {obj} on each day of the weekend."]
    a = sol.step(5, "*", wd, f"On weekdays {he} does {{calc}} {unit}.")
    b = sol.step(2, "*", we, f"On the weekend {he} does {{calc}} {unit}.")
    w = sol.step(a, "+", b, f"Each week {he} does {{calc}} {unit}.")
    q.append(f"How many {unit} does {he} do in {weeks} weeks?")
    ans = sol.step(w, "*", weeks, f"In {weeks} weeks {he} does {{calc}} {unit}.")
    return q, sol.lines, ans


def _t_discount(rng: random.Random):
    name, he, his = _person(rng)
    item, (lo, hi) = rng.choice(_SHOP)
    pct = rng.choice([10, 20, 25, 50])
    # price must be a multiple of 100/pct so the discount is a whole number of dollars
    unit = 100 // pct
    price = unit * rng.randint(max(1, lo // unit), max(2, hi // unit + 2))
    n = rng.randint(2, 8)
    sol = _Solution()
    q = [f"{_cap(item)} usually cost ${price} each.",
         f"During a sale everything is {pct}% off.", f"{name} buys {n} {item}."]
    full = sol.step(n, "*", price, f"Without the sale they would cost {{calc}} dollars.")
    off = sol.step(full, "/", 100 // pct, f"The discount is {pct}% of that, {{calc}} dollars.")
    q.append(rng.choice([f"How much does {he} pay?", f"How many dollars does {name} spend?"]))
    ans = sol.step(full, "-", off, f"{_cap(he)} pays {{calc}} dollars.")
    return q, sol.lines, ans


def _t_share_money(rng: random.Random):
    name, he, his = _person(rng)
    kids = rng.randint(2, 6)
    each = rng.randint(5, 40)
    total = kids * each
    spend = rng.randint(1, each)
    sol = _Solution()
    giver = rng.choice(["Grandma", "Grandpa", "Aunt May", "Uncle Joe", "Their mother", "Their father"])
    siblings = f"{his} sibling" if kids == 2 else f"{his} {kids - 1} siblings"
    q = [f"{giver} splits ${total} equally among {name} and {siblings}.",
         f"{name} spends ${spend} of {his} share on {rng.choice(['candy', 'a comic', 'stickers', 'a toy', 'lunch'])}."]
    kid_n = sol.step(1, "+", kids - 1, "There are {calc} children.")
    share = sol.step(total, "/", kid_n, "Each child gets {calc} dollars.")
    left = sol.step(share, "-", spend, f"{name} has {{calc}} dollars left.")
    if rng.random() < 0.4:
        earn = rng.randint(2, 30)
        q.append(f"Then {he} earns ${earn} doing chores. How much money does {he} have now?")
        ans = sol.step(left, "+", earn, f"{_cap(he)} now has {{calc}} dollars.")
    else:
        q.append(f"How much money does {name} have left?")
        ans = left
    return q, sol.lines, ans


def _t_legs(rng: random.Random):
    name, he, his = _person(rng)
    a_n, b_n = rng.randint(2, 30), rng.randint(2, 20)
    (a, al), (b, bl) = rng.sample([("chickens", 2), ("ducks", 2), ("cows", 4), ("goats", 4), ("sheep", 4),
                                   ("pigs", 4), ("horses", 4), ("geese", 2), ("spiders", 8)], 2)
    sol = _Solution()
    q = [f"{name}'s farm has {a_n} {a} and {b_n} {b}.", "How many legs do the animals have in total?"]
    la = sol.step(a_n, "*", al, f"The {a} have {{calc}} legs.")
    lb = sol.step(b_n, "*", bl, f"The {b} have {{calc}} legs.")
    ans = sol.step(la, "+", lb, "Altogether there are {calc} legs.")
    return q, sol.lines, ans


def _t_harvest(rng: random.Random):
    name, he, his = _person(rng)
    fruit, bag = rng.choice([("apples", "bag"), ("oranges", "crate"), ("lemons", "bag"), ("pears", "basket"),
                             ("peaches", "box"), ("plums", "basket")])
    trees, per_tree = rng.randint(3, 20), rng.randint(10, 60)
    per_bag = rng.choice([4, 5, 6, 8, 10, 12])
    sol = _Solution()
    tot = trees * per_tree
    if tot % per_bag:
        raise _Redraw
    price = rng.randint(2, 9)
    q = [f"{name} has {trees} {fruit[:-1] if fruit.endswith('s') else fruit} trees, and each tree gives {per_tree} {fruit}.",
         f"{_cap(he)} packs the {fruit} into {bag}s of {per_bag} and sells each {bag} for ${price}.",
         f"How much money does {he} make if {he} sells every {bag}?"]
    n = sol.step(trees, "*", per_tree, f"{_cap(he)} picks {{calc}} {fruit}.")
    bags = sol.step(n, "/", per_bag, f"That fills {{calc}} {bag}s.")
    ans = sol.step(bags, "*", price, f"{_cap(he)} makes {{calc}} dollars.")
    return q, sol.lines, ans


def _t_classroom(rng: random.Random):
    teacher, he, his = _person(rng)
    students = rng.randint(12, 40)
    d = rng.choice([d for d in (2, 3, 4, 5) if students % d == 0] or [None])
    if d is None:
        raise _Redraw
    sol = _Solution()
    q = [f"{teacher}'s class has {students} students.",
         rng.choice([f"{_cap(_FRACTIONS[d])} of them are on a field trip today.",
                     f"{_cap(_FRACTIONS[d])} of the students are out sick."])]
    away = sol.step(students, "/", d, "{calc} students are away.")
    here = sol.step(students, "-", away, "{calc} students are in class.")
    g = rng.choice(_divisors(here, 2, 6) or [None])
    if g is not None and rng.random() < 0.6:
        q.append(f"The students in class split into groups of {g}. How many groups are there?")
        ans = sol.step(here, "/", g, "There are {calc} groups.")
    else:
        per = rng.randint(2, 6)
        q.append(f"{teacher} gives each student in class {per} worksheets. How many worksheets does {he} hand out?")
        ans = sol.step(here, "*", per, f"{_cap(he)} hands out {{calc}} worksheets.")
    return q, sol.lines, ans


def _t_containers(rng: random.Random):
    name, he, his = _person(rng)
    goods, box = rng.choice(_GOODS)
    boxes, per = rng.randint(2, 15), rng.randint(4, 24)
    sol = _Solution()
    q = [rng.choice([f"{name} buys {boxes} {box}s of {goods}, with {per} {goods} in each {box}.",
                     f"A delivery brings {name} {boxes} {box}s of {goods}. Each {box} holds {per}."])]
    tot = sol.step(boxes, "*", per, f"There are {{calc}} {goods}.")
    bad = rng.randint(1, max(1, tot // 4))
    q.append(rng.choice([f"{bad} of them are damaged and thrown away.", f"{_cap(he)} finds that {bad} are spoiled."]))
    good = sol.step(tot, "-", bad, f"{{calc}} {goods} are good.")
    k = rng.choice(_divisors(good, 2, 9) or [None])
    if k is not None and rng.random() < 0.6:
        q.append(f"{_cap(he)} shares the good ones equally among {k} neighbors. How many does each neighbor get?")
        ans = sol.step(good, "/", k, "Each neighbor gets {calc}.")
    else:
        q.append(f"How many good {goods} are there?")
        ans = good
    return q, sol.lines, ans


_TEMPLATES: list[Callable] = [
    _t_collection, _t_collection, _t_shopping_change, _t_compare_people, _t_wages, _t_savings_goal, _t_travel,
    _t_ages, _t_recipe, _t_garden, _t_reading, _t_bakery, _t_tickets, _t_party, _t_exercise, _t_discount,
    _t_share_money, _t_legs, _t_harvest, _t_classroom, _t_containers,
]


# ----------------------------------------------------------------------------- public API

def _is_heldout_text(question: str) -> bool:
    # Half the question space belongs to each split; the hash decides, so identical texts always agree.
    return hashlib.sha256(question.encode()).digest()[0] & 1 == 1


def generate_problem(seed: int) -> dict:
    """Deterministic problem for `seed`: {'question', 'solution', 'answer' (int)}.

    Seeds in MATH_HELDOUT_SEEDS only yield held-out-bucket questions; all other non-negative seeds
    only yield train-bucket ones, so the two sets can never share a question text.
    """
    if seed < 0:
        raise ValueError("seed must be non-negative")
    want_heldout = seed in MATH_HELDOUT_SEEDS
    attempt = 0
    while True:
        rng = random.Random(f"domino-math/{GENERATOR_VERSION}/{seed}/{attempt}")
        attempt += 1
        template = rng.choice(_TEMPLATES)
        try:
            q, lines, answer = template(rng)
        except _Redraw:
            continue
        if not 2 <= len(lines) <= 6:
            continue
        question = " ".join(q)
        if _is_heldout_text(question) != want_heldout:
            continue
        solution = "\n".join(lines + [f"#### {answer}"])
        return {"question": question, "solution": solution, "answer": int(answer)}


def format_prompt(problem: dict) -> str:
    """The prompt shown to the model; the training text is prompt + ' ' + solution."""
    return f"Question: {problem['question']}\nAnswer:"


def format_text(problem: dict) -> str:
    return format_prompt(problem) + " " + problem["solution"]
