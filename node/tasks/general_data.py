"""Public general-instruction pairs mixed into the chat task's training pool.

Fine-tuning on docstring answers alone taught the adapters one register -- terse API prose --
and they used it for everything: asked "What is the capital of France?" without a system prompt,
two fine-tuned nodes looped on French words where the base model said "Paris". Rehearsing a
little general data (the remedy instruction-tuning recipes use against forgetting) keeps the
base model's manners. These pairs are written for fedkv, public (no node's data), asked without
a system prompt as a chat user would, and chosen away from every topic of the general-question
probe (``experiments.general_probe``: no capitals, calendars, sky, arithmetic, planets, bees,
oceans, spiders, ice or authors), so the probe measures retention, not rehearsal.
"""

from __future__ import annotations

from node.tasks.instruct_data import QAPair

GENERAL_MODULE = "<general>"
"""``QAPair.module`` of these pairs (no stdlib module has this name)."""

_PAIRS: tuple[tuple[str, str], ...] = (
    ("What is photosynthesis?", "Photosynthesis is how plants use sunlight, water and carbon dioxide to make sugar and release oxygen."),
    ("Why do we have seasons?", "Earth's axis is tilted, so each hemisphere gets more direct sunlight for part of the year."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Can you suggest a healthy breakfast?", "Oatmeal with fruit and a handful of nuts is a healthy, filling breakfast."),
    ("What does a thermometer measure?", "A thermometer measures temperature."),
    ("What is the main language spoken in Brazil?", "The main language of Brazil is Portuguese."),
    ("How do I say thank you in Spanish?", "In Spanish, thank you is \"gracias\"."),
    ("What is the tallest mountain in the world?", "Mount Everest, at about 8,849 metres above sea level."),
    ("What gas do humans need to breathe?", "Humans need oxygen to breathe."),
    ("How many sides does a triangle have?", "A triangle has three sides."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
    ("Give me a synonym for happy.", "A synonym for happy is joyful."),
    ("What is the plural of mouse?", "The plural of mouse is mice."),
    ("What is the largest desert in Africa?", "The Sahara is the largest desert in Africa."),
    ("What is the largest country by area?", "Russia is the largest country by area."),
    ("What does a doctor do?", "A doctor diagnoses and treats illnesses and injuries and helps people stay healthy."),
    ("What is the speed of light?", "Light travels at about 300,000 kilometres per second in a vacuum."),
    ("What instrument has black and white keys?", "The piano has black and white keys."),
    ("Which animal is known as the king of the jungle?", "The lion is known as the king of the jungle."),
    ("What is the main ingredient of guacamole?", "Avocado is the main ingredient of guacamole."),
    ("What is the longest river in South America?", "The Amazon is the longest river in South America."),
    ("Write a short greeting for a birthday card.", "Happy birthday! Wishing you a wonderful year full of joy and good health."),
    ("What is a noun?", "A noun is a word that names a person, place, thing or idea."),
    ("Why is exercise good for you?", "Exercise strengthens the heart and muscles, improves mood and helps you sleep better."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("In which country are the pyramids of Giza?", "The pyramids of Giza are in Egypt."),
    ("What metal is liquid at room temperature?", "Mercury is a metal that is liquid at room temperature."),
    ("How do plants get water?", "Plants take up water from the soil through their roots."),
    ("What is the first letter of the English alphabet?", "The first letter of the English alphabet is A."),
    ("What is a synonym for big?", "A synonym for big is large."),
    ("What is the hardest natural substance?", "Diamond is the hardest natural substance."),
    ("What is a verb?", "A verb is a word that describes an action or a state."),
    ("What does the heart do?", "The heart pumps blood through the body."),
    ("What is the currency of Japan?", "The currency of Japan is the yen."),
    ("Translate 'good morning' into French.", "Good morning in French is \"bonjour\"."),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong, in 1969."),
    ("What causes rain?", "Water vapour in clouds condenses into droplets that grow heavy and fall as rain."),
    ("Can you recommend a way to relax?", "Take a short walk, breathe slowly and deeply, or listen to calm music."),
)

GENERAL_PAIRS: tuple[QAPair, ...] = tuple(QAPair(GENERAL_MODULE, q, a, system=None) for q, a in _PAIRS)
"""The pairs, asked with the chat template's default system prompt (``system=None``)."""


def general_mix(count: int) -> tuple[QAPair, ...]:
    """``count`` general pairs, cycling through ``GENERAL_PAIRS`` in order (deterministic: the
    pool is the same on every node and every run)."""
    if count < 0:
        raise ValueError(f"general pair count must be >= 0, got {count}")
    return tuple(GENERAL_PAIRS[i % len(GENERAL_PAIRS)] for i in range(count))
