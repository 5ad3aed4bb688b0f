"""A fixed English text for ``duet eval ppl``, written for this project (nothing downloaded):
twelve short expository paragraphs on everyday subjects, 1,304 tokens for SmolLM2."""

PARAGRAPHS = [
    "A lighthouse is a tower built to guide ships along a dangerous coast. Before electric lamps, keepers burned "
    "whale oil, then kerosene, and spent their nights trimming wicks and polishing the great glass lens that "
    "gathered the weak flame into a beam visible for miles. Each lighthouse flashes in its own rhythm, so a "
    "sailor who counts the seconds between flashes can tell which headland lies ahead. Today most lights run "
    "by themselves, switched on by a sensor at dusk, and the keepers' cottages have become museums or holiday "
    "homes for people who like the sound of the sea.",
    "Bread begins with four things: flour, water, salt and yeast. When the dough is kneaded, proteins in the "
    "flour link into long elastic strands called gluten. The yeast feeds on sugars and releases carbon dioxide, "
    "and the gluten traps the gas in thousands of small bubbles, so the dough rises. Baking sets the structure: "
    "the heat kills the yeast, the starch firms up, and the surface browns as sugars and proteins react. A slow "
    "rise in a cool kitchen gives the yeast and bacteria time to make the flavours that a quick loaf lacks.",
    "The bicycle chain is a small marvel of engineering. Each link is made of two plates held by pins, and each "
    "pin turns inside a roller that meets the teeth of the sprocket. When the rider pushes the pedal, the front "
    "sprocket pulls the chain, and the chain turns the rear wheel. Gears change how far the wheel turns for each "
    "turn of the pedals: a large front sprocket and a small rear one make the bike fast on flat roads, while the "
    "opposite pair makes steep hills possible at the cost of speed. A clean, oiled chain wastes very little of "
    "the rider's effort.",
    "Honey bees live in colonies of many thousands, yet only one queen lays the eggs. The workers, all female, "
    "change jobs as they age. Young bees clean cells and feed the larvae; older ones build wax comb, guard the "
    "entrance, and finally fly out to gather nectar and pollen. A forager that finds a rich patch of flowers "
    "returns and performs a dance on the comb. The angle of the dance shows the direction of the flowers "
    "relative to the sun, and its length tells the others how far they must fly.",
    "Glaciers form where more snow falls in winter than melts in summer. Year after year the snow piles up and "
    "presses the layers below into dense blue ice. When the ice is thick enough, its own weight makes it flow "
    "downhill, very slowly, like cold honey. As a glacier moves it scrapes the rock beneath it, carving wide "
    "valleys with steep sides and carrying boulders far from where they started. Many of the lakes and rounded "
    "hills of northern countries were shaped by ice sheets that melted about ten thousand years ago.",
    "A library catalogue answers a simple question: where is the book I want? Early libraries kept handwritten "
    "lists, then cards in long wooden drawers, each card naming the author, the title and a number that told the "
    "reader which shelf to visit. The numbers follow a scheme that places books on similar subjects side by "
    "side, so a reader who finds one useful book often finds three more next to it. Computers replaced the "
    "drawers, but the idea of arranging knowledge so that neighbours are related has not changed.",
    "Tides rise and fall twice a day on most coasts because of the pull of the moon. The moon's gravity draws "
    "the ocean toward it on the near side of the earth, and on the far side the water bulges away as the earth "
    "itself is pulled a little more strongly than the sea. As the earth turns, a coast passes through both "
    "bulges. When the sun and moon line up, at new moon and full moon, their pulls add together and the tides "
    "are larger. Harbour towns print tables that tell fishermen when the water will be deep enough to sail.",
    "Learning to play a musical instrument trains more than the fingers. A beginner must read the notes, count "
    "the beat, listen to the sound and adjust, all at once. At first every step needs attention, and progress "
    "feels slow. With steady practice the small movements become automatic, and the mind is free to think about "
    "phrasing and feeling. Teachers often advise short daily sessions rather than one long one each week, since "
    "the brain seems to settle new skills during the rest between them.",
    "Paper was first made in China about two thousand years ago from the bark of mulberry trees, old rags and "
    "hemp. The fibres were soaked and beaten into a pulp, spread on a fine screen, pressed and dried into "
    "sheets. The craft travelled west along trade routes and reached Europe many centuries later, where mills "
    "used water wheels to beat the rags. Cheap paper, together with the printing press, let books and letters "
    "spread far more widely than before, and ideas moved faster than any traveller could carry them.",
    "A good map leaves things out. A road atlas shows highways, towns and petrol stations but ignores the shape "
    "of the hills; a walker's map marks every footpath, stream and contour line but would be useless for "
    "driving across a country. The map maker chooses a scale, decides what the reader needs, and draws only "
    "that, using symbols that are explained in a key. Learning to read contour lines takes a little practice: "
    "where they crowd together the ground is steep, and where they spread apart it is gentle.",
    "Volcanoes are openings in the earth's crust where melted rock, gas and ash escape from below. Some erupt "
    "gently, sending rivers of glowing lava down their slopes; others explode, throwing ash high into the sky. "
    "The difference lies mostly in the rock itself. Runny lava lets gas escape easily, while thick, sticky lava "
    "traps it until the pressure bursts out all at once. Scientists watch for small earthquakes, swelling ground "
    "and changes in the gases a volcano gives off, and these signs can give people living nearby time to leave.",
    "Writing a clear set of instructions is harder than it looks. The writer already knows the task, so steps "
    "that seem obvious are easily skipped. A useful test is to hand the instructions to someone who has never "
    "done the job and watch, without helping, where they hesitate. Each pause marks a missing step or an "
    "unclear word. Short sentences, one action per step, and a note of what the reader should see when a step "
    "is done make most instructions much easier to follow.",
]

TEXT = "\n\n".join(PARAGRAPHS)
