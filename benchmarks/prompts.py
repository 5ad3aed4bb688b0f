"""Chat prompts of mixed lengths (about 5 to 600 tokens): the parity tests' (greedy output against
transformers) and ``duet eval ppl``'s (a quantized setting's greedy output against fp32's)."""

# New tokens per parity prompt, compared with transformers.
PARITY_NEW_TOKENS = 64

PARAGRAPHS = [
    "The lighthouse on the northern cape was built in 1874 from granite quarried two miles inland. "
    "Its keeper, a retired ship's carpenter named Elias Brandt, kept a log of every vessel that passed, "
    "noting the weather, the direction of the wind and the colour of the sea at dawn.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, "
    "chlorophyll absorbs mostly blue and red light, and the energy drives the splitting of water "
    "molecules, releasing oxygen and producing the ATP and NADPH used to fix carbon dioxide into sugars.",
    "The city council met on Tuesday to discuss the new bicycle lanes. Supporters argued that the lanes "
    "would reduce traffic and improve air quality, while shop owners on Market Street worried that the "
    "loss of parking spaces would drive customers to the mall on the edge of town.",
    "A binary search tree stores keys so that every node's left subtree holds smaller keys and its right "
    "subtree larger ones. Searching, inserting and deleting take time proportional to the height of the "
    "tree, which is why balanced variants such as red-black trees and AVL trees were invented.",
    "In the spring of 1903 the expedition left the coast with forty mules, six guides and enough flour "
    "for three months. By midsummer half the mules had been lost on the mountain passes, and the guides "
    "refused to go further than the salt lake, where the party camped for eleven days.",
    "Sourdough bread relies on a culture of wild yeast and lactic acid bacteria. The baker feeds the "
    "starter with flour and water, waits for it to double, and mixes it into the dough, which then rises "
    "slowly for many hours and develops the sour flavour and open crumb the bread is known for.",
]

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about autumn leaves.",
    "Explain what a prime number is in one sentence.",
    "Give me two tips for learning to play the guitar.",
    "What is 17 plus 25?",
    "Translate 'good morning' into Spanish.",
]


def _document(num_paragraphs: int, start: int) -> str:
    return "\n\n".join(PARAGRAPHS[(start + i) % len(PARAGRAPHS)] for i in range(num_paragraphs))


def parity_conversations() -> list[list[dict]]:
    """16 conversations: 8 short questions, 8 questions about documents of growing length."""
    conversations = [[{"role": "user", "content": question}] for question in QUESTIONS]
    # A terse system prompt replaces the template's default one: the shortest prompts.
    conversations[0].insert(0, {"role": "system", "content": "Be brief."})
    conversations[6].insert(0, {"role": "system", "content": "Answer with a number."})
    tasks = ["Summarise the text above in two sentences.", "What is the main topic of the text above?"]
    for index in range(8):
        document = _document(1 + index + index // 4, index)
        conversations.append([{"role": "user", "content": f"{document}\n\n{tasks[index % 2]}"}])
    return conversations


SHARED_SYSTEM_PROMPT = (
    "You are a careful assistant for a small library. Answer briefly and politely. "
    "Here is background material you may use:\n\n" + _document(4, 0)
)


def shared_prefix_conversations() -> list[list[dict]]:
    """Conversations that share a long system prompt, so later ones hit the prefix cache."""
    return [
        [{"role": "system", "content": SHARED_SYSTEM_PROMPT}, {"role": "user", "content": question}]
        for question in QUESTIONS
    ]


def encode_conversations(tokenizer, conversations) -> list[list[int]]:
    """Chat-template token ids, with the assistant turn opened."""
    encoded = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in conversations]
    return [list(e["input_ids"] if hasattr(e, "keys") else e) for e in encoded]
