"""Hand-written arithmetic word problems for the `unseen` and `fresh` evaluation sets: phrased unlike the math
generator's templates (other names, objects, sentence shapes and question forms), so they test whether a drafter
learned the target's behaviour or the generator's wording. Never used for training or regeneration."""

UNSEEN_WORD_PROBLEMS = (
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

# The `fresh` evaluation set's word problems, written on 2026-12-02 after the shipped drafters and every decoding
# default had been chosen: times, money with cents, percentages, rates and remainders, in shapes that neither the
# generator nor the list above uses. Never used for training, regeneration or tuning.
FRESH_WORD_PROBLEMS = (
    "A train leaves at 9:40 and the trip takes 2 hours and 35 minutes. At what time does it arrive?",
    "Priya buys 4 notebooks at 3 dollars 25 cents each and pays with a 20 dollar bill. How much change does she get?",
    "A swimming pool holds 600 cubic metres and is three quarters full. A hose adds 15 cubic metres an hour. How "
    "many hours until the pool is full?",
    "Leon is 4 years older than his sister, and together they are 30 years old. How old is Leon?",
    "A shop marks a 60 dollar coat down by 25 percent, then takes 5 dollars more off at the till. What is the final "
    "price?",
    "Three friends share a pizza cut into 12 slices. Ana eats 5, Ben eats a third of the pizza, and Chen eats the "
    "rest. How many slices does Chen eat?",
    "A garden is 18 metres long and 7 metres wide. Fencing costs 4 dollars a metre. What does it cost to fence the "
    "whole garden?",
    "Hana runs 400 metres in 80 seconds. At the same pace, how many seconds would 1500 metres take her?",
    "A crate of 144 eggs arrives, and 1 in every 12 eggs is cracked. The good eggs are packed in boxes of 6. How "
    "many boxes are filled?",
    "Rosa's phone battery drops 8 percent every hour. She unplugs it at 100 percent at 7 in the morning. What is "
    "the charge at 1 in the afternoon?",
    "A bus has 52 seats. At the first stop 19 people get on, at the second 23 get on and 7 get off. How many seats "
    "are still free?",
    "A recipe needs 250 grams of flour for 10 biscuits. How much flour is needed for 34 biscuits?",
    "Yuki practises the piano for 45 minutes on weekdays and 90 minutes on each weekend day. How many hours does "
    "she practise in a week?",
    "A hall has 16 tables of 8 chairs and 12 tables of 6 chairs. The guest list has 190 names. How many guests "
    "will have no chair?",
    "Marco earns 14 dollars an hour and works 6 hours a day for 5 days. He puts half of his pay in the bank. How "
    "much does he put in the bank?",
    "A printer prints 35 pages a minute. How long does it take, in minutes, to print 20 copies of a 21 page report?",
    "In a class of 30 pupils, 40 percent walk to school, 9 come by bus and the rest are driven. How many are "
    "driven?",
    "A rope 96 centimetres long is cut into pieces of 14 centimetres. How many whole pieces are there and how much "
    "rope is left?",
    "Dana's car uses 6 litres of fuel per 100 kilometres. Fuel costs 2 dollars a litre. What does a 450 kilometre "
    "trip cost?",
    "A clock gains 3 minutes every day. It is set right on a Monday at noon. How many minutes fast is it at noon "
    "the next Monday?",
)
