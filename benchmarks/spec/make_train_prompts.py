"""Writes slipstream/spec/data/train_prompts.txt: the chat prompts the shipped
Medusa / EAGLE heads are trained on (the target answers them itself).

The prompts are built from templates and topic lists written for this file
(no outside text): explanations, why-questions, how-to questions, lists of tips,
comparisons, poems and stories, retellings of folk tales and classics, history,
short code tasks, arithmetic word problems, messages and summaries. Deterministic (seeded); none equals a line of
benchmarks/spec/prompts.txt, the benchmark prompts.

    python benchmarks/spec/make_train_prompts.py [--count 8000]
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[1] / "slipstream" / "spec" / "data" / "train_prompts.txt"

SCIENCE = """photosynthesis|gravity|electricity|magnetism|a rainbow|thunder and lightning|the tides|
the seasons|volcanoes|earthquakes|the immune system|DNA|vaccines|black holes|the moon's phases|
evaporation|sound waves|the greenhouse effect|plate tectonics|a solar eclipse|friction|
the human heart|digestion|nuclear fusion|batteries|the speed of light|clouds|erosion|
the periodic table|chemical reactions|bacteria|viruses|the nervous system|sleep|muscles|
a magnet|static electricity|the ozone layer|ocean currents|fossils|the Big Bang|comets|
evolution by natural selection|enzymes|the water table|glaciers|a lunar eclipse|hurricanes|
the food chain|pollination|the brain|blood types|antibiotics|stars|the northern lights|
wind|snowflakes|metabolism|genes|cells|the skeleton|lungs and breathing|hibernation|
bird migration|coral reefs|deserts|rainforests|the atmosphere|air pressure|buoyancy|
inertia|energy conservation|heat and temperature|light refraction|lenses|mirrors|
radio waves|microwaves|x-rays|radioactivity|acids and bases|salt dissolving in water|
rust|fire|soap|yeast and bread rising|fermentation|the placebo effect|memory|dreams""".replace("\n", "")

TECH = """a computer|the internet|a search engine|email|a smartphone|GPS|Wi-Fi|Bluetooth|
a web browser|cloud computing|a database|an operating system|a compiler|encryption|passwords|
a firewall|machine learning|a neural network|a CPU|RAM|a hard drive|an SSD|a keyboard|
a touchscreen|a printer|a digital camera|a microwave oven|an electric car|a solar panel|
a wind turbine|a jet engine|a helicopter|a bicycle gear|a lock and key|a light bulb|an LED|
a thermostat|a dishwasher|a washing machine|a vacuum cleaner|a bridge|an elevator|
a satellite|a rocket|a submarine|a train|a clock|a barcode|a QR code|a credit card|
version control|open source software|a spreadsheet|a video game|streaming video|
data compression|a programming language|recursion|a hash table|sorting algorithms|
binary numbers|a URL|a server|an API|a virus scanner|a 3D printer|a robot|a drone""".replace("\n", "")

HISTORY = """the ancient Egyptians|the pyramids|ancient Greece|the Olympic Games|the printing press|
the Industrial Revolution|the Renaissance|the Vikings|the Silk Road|the Middle Ages|
castles|the invention of writing|the invention of the wheel|the first airplanes|
the moon landing|the history of the telephone|the history of money|ancient Rome's roads|
the Great Wall of China|the age of exploration|the history of chess|the history of tea|
the history of coffee|the invention of paper|early calendars|the history of maps|
lighthouses|the history of the bicycle|medieval knights|the history of libraries|
the history of music notation|the first computers|the history of photography|
the steam locomotive|the history of vaccines|ancient Mesopotamia|the Maya|the Inca|
the history of the post office|the history of board games""".replace("\n", "")

EVERYDAY = """saving money|cooking rice|making a budget|planting tomatoes|keeping a houseplant alive|
organizing a closet|cleaning a kitchen|packing for a trip|writing a resume|preparing for a job
interview|running a first 5k|starting to meditate|getting better sleep|drinking more water|
learning to juggle|learning to swim|learning to draw|learning the guitar|reading more books|
waking up early|making friends in a new city|taking care of a dog|taking care of a cat|
feeding birds in winter|baking bread|making pancakes|brewing tea|making a smoothie|
reducing food waste|recycling at home|saving energy at home|fixing a flat bicycle tire|
painting a room|hanging a picture|choosing a laptop|backing up files|
writing a thank-you note|planning a birthday party|hosting a dinner|camping for the first time|
hiking safely|staying cool in summer|staying warm in winter|working from home|
managing stress|public speaking|taking notes in class|preparing for an exam|
learning vocabulary|keeping a journal|decluttering a room|moving to a new home|
training a puppy|growing herbs on a windowsill|composting|making a to-do list|
setting goals|ironing a shirt|sewing a button|caring for leather shoes""".replace("\n", " ")

ANIMALS = """octopuses|dolphins|elephants|owls|bees|ants|penguins|sharks|whales|cats|dogs|horses|
butterflies|spiders|frogs|turtles|eagles|bats|camels|giraffes|kangaroos|koalas|wolves|foxes|
crows|parrots|snails|jellyfish|squirrels|hedgehogs|beavers|tigers|lions|zebras|pandas|
hummingbirds|seahorses|salmon|chameleons|flamingos""".replace("\n", "")

PLACES = """a busy train station|a mountain village|a desert at noon|a lighthouse in a storm|
a library at closing time|a small bakery|a city park in spring|a harbor at dawn|
an old attic|a snowy cabin|a rainy street|a market in summer|a school on the last day|
a garden after rain|a quiet lake|a space station|a farm at sunrise|a bus at midnight|
a forest in autumn|a beach in winter|a bookshop|a kitchen on a holiday|a river at dusk|
a hospital waiting room|an empty theater|a rooftop at night|a field of sunflowers|
a fishing boat|a train crossing a bridge|a hill above a town""".replace("\n", "")

CODE_TASKS = """checks whether a number is prime|reverses a string|counts the vowels in a string|
returns the largest element of a list|removes duplicates from a list while keeping order|
checks whether a word is a palindrome|computes the factorial of n|merges two sorted lists|
flattens a nested list|counts word frequencies in a text|converts Celsius to Fahrenheit|
finds the second largest number in a list|checks whether two strings are anagrams|
computes the greatest common divisor of two numbers|returns the n-th triangular number|
sums the digits of an integer|converts a binary string to an integer|
splits a list into chunks of size k|rotates a list by k positions|
returns the indices of two numbers that add up to a target|checks whether brackets are balanced|
capitalizes the first letter of every word|computes the mean and median of a list|
finds the longest word in a sentence|implements binary search|implements bubble sort|
transposes a matrix|checks whether a year is a leap year|generates the first n prime numbers|
counts the lines in a file|reads a CSV file and prints each row|
returns the common elements of two lists|computes the power set of a small list|
converts a number to Roman numerals|validates a simple email address|
computes a running total of a list|finds the mode of a list|
removes all whitespace from a string|checks whether a list is sorted|
returns the Fibonacci numbers below a limit as a list""".replace("\n", "")

LANGS = ["Python", "JavaScript", "C", "Go", "Rust", "Java"]

FOODS = """lentil soup|banana bread|a vegetable stir-fry|guacamole|pancakes|omelette|
a simple salad dressing|roasted vegetables|hummus|fried rice|apple crumble|oatmeal cookies|
a fruit salad|pasta with garlic and oil|chicken curry|a tuna sandwich|pizza dough|
mashed potatoes|lemonade|a bean chili|scrambled eggs|a yogurt parfait|potato salad|
corn bread|pumpkin soup|a cheese omelette|vegetable dumplings|rice pudding""".replace("\n", "")

JOBS = """a nurse|a teacher|a firefighter|a pilot|a chef|a librarian|a software engineer|
an architect|a farmer|a veterinarian|a journalist|an electrician|a pharmacist|a dentist|
a park ranger|a plumber|an astronaut|a musician|a translator|a carpenter""".replace("\n", "")

PAIRS = """a lake and a pond|weather and climate|a virus and a bacterium|speed and velocity|
mass and weight|a meteor and a meteorite|a frog and a toad|a crocodile and an alligator|
RAM and storage|a list and a tuple in Python|HTTP and HTTPS|a rabbit and a hare|
a simile and a metaphor|an ocean and a sea|a democracy and a monarchy|weather forecasts and
climate models|AC and DC electricity|a comet and an asteroid|baking soda and baking powder|
a credit card and a debit card|renting and buying a home|a moth and a butterfly|
a hurricane and a tornado|fruits and vegetables|a city and a town|tea and coffee|
an emulator and a simulator|a compiler and an interpreter|a mountain and a hill|
a poem and a song|a democracy and a monarchy|a comet and an asteroid|a frog and a toad|
an alligator and a crocodile|baking soda and baking powder|a meteor and a meteorite|
an ocean and a sea|a town and a city|a simile and a metaphor|mass and weight|
a hurricane and a tornado|an element and a compound|a fruit and a vegetable|
a butterfly and a moth|DNA and RNA|a CPU and a GPU|a novel and a short story|
empathy and sympathy|saving and investing|a plant cell and an animal cell|
mitosis and meiosis|AC and DC current|a stock and a bond|a dialect and a language""".replace("\n", "")

PEOPLE = """a friend|a coworker|my landlord|a teacher|my neighbour|a customer|my manager|
a new colleague|my grandmother|a team member|a club member|my cousin""".replace("\n", "")

REASONS = """to thank them for their help|to apologize for being late|to ask for a day off|
to invite them to a picnic|to congratulate them on a new job|to reschedule a meeting|
to ask for feedback on a project|to welcome them to the team|to remind them about a deadline|
to say goodbye before moving away|to ask to borrow a ladder|to wish them a happy birthday|
to cancel a dinner plan politely|to ask for a recommendation letter""".replace("\n", " ")

STORY_HEROES = """a shy robot|a lost kitten|a young inventor|an old sailor|a talking tree|
a curious girl|a brave mouse|a lonely dragon|a clumsy wizard|a retired detective|
a baker who cannot smell|a lighthouse keeper|a boy with an old map|a friendly ghost|
a musician with no instrument|a snail who wants to race""".replace("\n", "")

STORY_EVENTS = """finds a secret door|learns to fly|makes an unexpected friend|
loses something important|wins a contest|gets lost in a big city|solves a mystery|
has to cross a river|discovers a hidden garden|meets a stranger on a train""".replace("\n", " ")

TALES = """Little Red Riding Hood|Hansel and Gretel|Snow White|Jack and the Beanstalk|
the Tortoise and the Hare|Goldilocks and the Three Bears|Rapunzel|the Ugly Duckling|
the Little Mermaid|Pinocchio|Robin Hood|King Arthur and the sword in the stone|Aladdin|
Sleeping Beauty|the Three Little Pigs|Rumpelstiltskin|the Boy Who Cried Wolf|Romeo and Juliet|
Hamlet|the Odyssey|Beauty and the Beast|Peter Pan|Alice in Wonderland|Treasure Island|
Frankenstein|Moby-Dick|Don Quixote|the Emperor's New Clothes|the Frog Prince|Puss in Boots|
the Pied Piper of Hamelin|the Gingerbread Man|the Snow Queen|the Princess and the Pea|
Rip Van Winkle|the Legend of Sleepy Hollow|Gulliver's Travels|Robinson Crusoe|
the Wizard of Oz|the Jungle Book|Sherlock Holmes and the Hound of the Baskervilles|
a Christmas Carol|the Lion and the Mouse|the Fox and the Grapes|King Midas and the golden touch|
Icarus|Pandora's box|Theseus and the Minotaur|the Trojan Horse""".replace("\n", "")

WHY = """Why is the sky blue?|Why do cats purr?|Why does ice float on water?|Why do we yawn?|
Why do stars twinkle?|Why is the ocean salty?|Why do birds sing in the morning?|
Why do onions make us cry?|Why do we have fingerprints?|Why does bread go stale?|
Why do zebras have stripes?|Why does the moon change shape?|Why do we get goosebumps?|
Why do dogs wag their tails?|Why do we need sleep?|Why do some animals hibernate?|
Why does metal feel colder than wood?|Why do apples turn brown after cutting?|
Why is the grass green?|Why do we sneeze?|Why do bees make honey?|Why do volcanoes erupt?|
Why does a compass point north?|Why do our ears pop on a plane?|Why is snow white?|
Why do some people need glasses?|Why do we have seasons?|Why do fish swim in schools?|
Why does the sun set in the west?|Why do bubbles pop?|Why do rivers bend?|
Why do flowers smell nice?|Why does thunder follow lightning?|Why do we hiccup?|
Why does popcorn pop?|Why is exercise good for the heart?|Why do birds fly south?|
Why does milk go sour?|Why do our fingers wrinkle in water?|Why do camels have humps?|
Why does a boat float?|Why do we dream?|Why do mosquitoes bite?|Why do spiders spin webs?|
Why do cacti have spines?|Why does the wind blow?|Why is the desert cold at night?""".replace("\n", "")

CONCEPTS = """democracy|inflation|supply and demand|interest rates|taxes|a constitution|
the stock market|a mortgage|insurance|globalization|recycling|climate change|biodiversity|
the scientific method|probability|fractions|percentages|the Pythagorean theorem|prime numbers|
algebra|statistics|logic|ethics|empathy|leadership|teamwork|procrastination|motivation|stress|
nutrition|a balanced diet|vitamins|the water cycle|gross domestic product|a market economy|
compound interest|a credit score|the law of gravity|an ecosystem|a habitat|a molecule|
an electric circuit|a chemical bond|kinetic energy|a fraction of a number|an average|
a hypothesis|critical thinking|free speech|a budget deficit|urban planning|renewable resources""".replace("\n", "")

EMPIRES = """ancient China|the Ottoman Empire|the Byzantine Empire|the Aztec Empire|feudal Japan|
the Persian Empire|ancient India|the Mongol Empire|the Greek city-states|medieval Europe|
the Ming dynasty|the Han dynasty|the Egyptian New Kingdom|the Mali Empire|the Carolingian Empire|
the Hanseatic League|the Khmer Empire|the Viking Age|the Spanish Empire|Ancient Carthage|
the Qing dynasty|the Mughal Empire|the Incan Empire|the Babylonian Empire""".replace("\n", "")

MACHINES = """a refrigerator|a car engine|a windmill|a water wheel|a sewing machine|a telescope|
a microscope|a piano|a radio|a toaster|an air conditioner|a parachute|a sailboat|
a hot air balloon|a pendulum clock|a nuclear power plant|a hydroelectric dam|a heat pump|
an electric motor|a generator|a camera|a loudspeaker|a microphone|a battery charger|
a traffic light|a vending machine|a smoke detector|a thermometer|a barometer|a canal lock""".replace("\n", "")

HABITS = """stay motivated|sleep better|make new friends|manage my time|be more productive|
reduce stress|improve my memory|speak more confidently|learn a new language faster|
eat healthier|save for a holiday|stop procrastinating|become a better listener|
keep my room tidy|prepare for an exam|handle criticism|wake up earlier|
spend less time on my phone|build a new habit|write better emails|stay calm in traffic|
keep a journal|read faster|get along with my roommate|feel less lonely|be more creative|
remember people's names|keep my plants healthy|cook more at home|exercise without a gym""".replace("\n", "")

THEMES = """the first snow|a summer evening|the sea at dawn|a rainy afternoon|an old oak tree|
city lights at night|a mountain lake|friendship|hope|time passing|the stars|a garden in spring|
a lonely lighthouse|autumn wind|a cup of tea|a sleeping cat|the last day of school|
a long road trip|the full moon|a thunderstorm|home|an empty beach|a morning walk|courage""".replace("\n", "")

MOODS = ["hopeful", "funny", "calm", "mysterious", "sad", "cheerful", "nostalgic"]

NUMBERS = list(range(2, 60))

TEMPLATES = [
    (SCIENCE, ["Explain {x} in simple terms.", "How does {x} work?", "What is {x}?",
               "Explain {x} to a ten-year-old.", "Why is {x} important?",
               "Give me three facts about {x}.", "What are common misconceptions about {x}?",
               "Describe {x} in one paragraph."]),
    (TECH, ["How does {x} work?", "Explain what {x} is.", "What are the main parts of {x}?",
            "Explain {x} to someone who has never used one.", "What are the advantages of {x}?",
            "Describe the history of {x} briefly.", "What problems does {x} solve?"]),
    (HISTORY, ["Tell me about {x}.", "Why was {x} important?", "Summarize {x} in a few sentences.",
               "What are three interesting facts about {x}?", "What can we learn from {x}?"]),
    (EVERYDAY, ["Give me tips for {x}.", "How do I get started with {x}?",
                "What are common mistakes when {x}?", "Make a step-by-step plan for {x}.",
                "Give me five tips for {x}.", "What should a beginner know about {x}?"]),
    (ANIMALS, ["Tell me about {x}.", "What do {x} eat?", "Where do {x} live?",
               "What are some surprising facts about {x}?", "How do {x} communicate?",
               "Write a short poem about {x}.", "Explain how {x} raise their young."]),
    (PLACES, ["Describe {x}.", "Write a short poem about {x}.",
              "Write a {mood} paragraph set in {x}.", "Write a haiku about {x}.",
              "Describe the sounds and smells of {x}."]),
    (CODE_TASKS, ["Write a {lang} function that {x}.", "Write a {lang} function that {x}, "
                  "with a short explanation.", "Show me how to write a function that {x} in {lang}."]),
    (FOODS, ["Give me a simple recipe for {x}.", "How do I make {x}?",
             "What ingredients do I need for {x}?", "How can I make {x} healthier?"]),
    (JOBS, ["What does {x} do?", "Describe a typical day of {x}.",
            "What skills does {x} need?", "How does someone become {x}?"]),
    (PAIRS, ["What is the difference between {x}?", "Compare {x}.",
             "Explain the difference between {x} with an example."]),
    (TALES, ["Summarize the story of {x}.", "Tell me the story of {x} in a few sentences.",
             "What is the moral of {x}?", "Who are the main characters in {x}?"]),
    (CONCEPTS, ["Explain what {x} is.", "Explain {x} in simple terms.", "Why does {x} matter?",
                "Give an example of {x}.", "What are the pros and cons of {x}?"]),
    (EMPIRES, ["Describe the main features of {x}.", "What was daily life like in {x}?",
               "Why did {x} decline?", "What are three interesting facts about {x}?"]),
    (MACHINES, ["Explain how {x} works.", "How does {x} work?", "What are the main parts of {x}?",
                "Who invented {x}, and why?"]),
    (HABITS, ["How can I {x}?", "Give me five tips to {x}.", "What stops people from trying to {x}?"]),
    (THEMES, ["Write a short poem about {x}.", "Write a haiku about {x}.",
              "Write a four-line rhyme about {x}.", "Write a {mood} poem about {x}."]),
]


def _split(s: str) -> list[str]:
    return [w.strip() for w in s.split("|") if w.strip()]


def generate(count: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    pool: list[str] = []
    for topics, forms in TEMPLATES:
        for x in _split(topics):
            for f in forms:
                if "{lang}" in f:
                    for lang in LANGS:
                        pool.append(f.format(x=x, lang=lang))
                else:
                    pool.append(f.format(x=x, mood=rnd.choice(MOODS)))
    for who in _split(PEOPLE):
        for why in _split(REASONS):
            pool.append(f"Write a short message to {who} {why}.")
    pool.extend(_split(WHY))
    for hero in _split(STORY_HEROES):
        for ev in _split(STORY_EVENTS):
            pool.append(f"Write a short story about {hero} who {ev}.")
    for _ in range(400):
        a, b, c = rnd.sample(NUMBERS, 3)
        item = rnd.choice(["apples", "books", "pencils", "marbles", "stickers", "cookies", "coins"])
        pool.append(rnd.choice([
            f"If I have {a} {item} and buy {b} more, then give away {c}, how many do I have?",
            f"A box holds {a} {item}. How many {item} are in {b} boxes? Show your work.",
            f"What is {a} times {b} plus {c}? Explain each step.",
            f"Share {a * b} {item} equally among {b} friends. How many does each get?",
            f"A train travels {a * 10} km in {b} hours. What is its average speed?",
        ]))
    pool = sorted(set(pool))
    bench = {s.strip().lower() for s in (HERE / "prompts.txt").read_text().splitlines()}
    pool = [p for p in pool if p.lower() not in bench]
    rnd.shuffle(pool)
    return pool[:count]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    prompts = generate(args.count, args.seed)
    Path(args.out).write_text("\n".join(prompts) + "\n")
    print(f"{len(prompts)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
