"""Hand-written arithmetic word problems for the `unseen` evaluation set: phrased unlike the math generator's
templates (other names, objects, sentence shapes and question forms), so they test whether a drafter learned the
target's behaviour or the generator's wording. Never used for training or regeneration."""

WORD_PROBLEMS = (
    "A library lends out 37 books on Monday and twice as many on Tuesday. On Wednesday 15 of the borrowed books come "
    "back. How many books are still out?",
    "Tomasz drives 62 kilometres to the coast, then 18 kilometres along it, and takes the same road home. How far "
    "does he drive in total?",
    "A farmer plants 9 rows of lettuce with 24 heads in each row. Rabbits eat 31 heads. How many heads are left to "
    "sell?",
    "The school choir has 48 singers. One quarter of them are tenors and 14 are altos. The rest are sopranos. How "
    "many sopranos are there?",
    "Ines saves 7 euros every week for 16 weeks and then spends 45 euros on a jacket. How much money does she have "
    "left?",
    "A ferry carries 120 passengers per trip and makes 5 trips a day. On Sunday it runs only 3 trips. How many "
    "passengers can it carry on Sunday?",
    "A box holds 6 jars of honey, and each jar weighs 350 grams. What do 4 boxes of honey weigh in grams?",
    "Kwame reads 23 pages each evening. His novel has 322 pages. After how many evenings does he finish it?",
    "A bakery sells croissants at 2 dollars and muffins at 3 dollars. Yesterday it sold 41 croissants and 27 muffins. "
    "How much money did it take in?",
    "There are 5 classrooms with 28 desks each. The janitor removes 3 broken desks from every room. How many desks "
    "remain?",
    "A cyclist rides 15 kilometres every hour. How many kilometres does she cover in 3 hours and then 2 more hours "
    "after lunch?",
    "Mei has 3 packs of stickers with 40 stickers in each. She gives 18 to her brother and 25 to a friend. How many "
    "stickers does she keep?",
    "An orchard has 14 apple trees. Each tree gives 36 apples, and 58 apples are bruised. How many good apples are "
    "picked?",
    "A theatre has 22 rows of 30 seats. For the matinee 517 tickets are sold. How many seats stay empty?",
    "Oskar pays 84 dollars for 7 identical shirts. How much would 11 of the same shirts cost?",
    "A water tank holds 900 litres. A pump removes 75 litres each minute. How many litres are left after 8 minutes?",
)
