"""Keeping what the model knew: general prompts that are not the task, scored before and after training.

The tutorials warn that RL on one task can make a pretrained model forget the rest. On 50 general
instructions (below), the reference model (`retention_base`, e.g. the pretrained model before SFT) answers
greedily once; then each policy is measured on those fixed answers:

    nll   mean negative log-likelihood per token of the reference's own answers under the policy
    kl    mean per-token KL(policy || reference) over the full vocabulary at the same positions

Both are teacher-forced on the same token ids, so they are deterministic and comparable across runs; the
reference has nll at its minimum for its own greedy answers and kl 0.
"""

from __future__ import annotations

import torch

GENERAL_PROMPTS = (
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what photosynthesis is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "Why is the sky blue?",
    "Write a friendly reminder to water the plants.",
    "List four fruits that are red.",
    "How do I boil an egg?",
    "What does a librarian do?",
    "Describe a cat to someone who has never seen one.",
    "What are the three states of water?",
    "Write a one-sentence story about a dragon.",
    "Who wrote Romeo and Juliet?",
    "What is a good way to start a conversation with a new colleague?",
    "Explain what a noun is.",
    "Give an example of a healthy breakfast.",
    "What is the largest planet in our solar system?",
    "How can I make my handwriting neater?",
    "Write a thank-you note to a teacher.",
    "What is the opposite of 'generous'?",
    "Name three instruments in an orchestra.",
    "Why do leaves change colour in autumn?",
    "What should I pack for a day at the beach?",
    "Summarise the plot of Cinderella in two sentences.",
    "What is the boiling point of water at sea level?",
    "Suggest a hobby for someone who likes being outdoors.",
    "Explain what a computer virus is.",
    "Write a haiku about winter.",
    "What is the main ingredient of guacamole?",
    "How many days are there in a leap year?",
    "Give me a synonym for 'happy'.",
    "What does the heart do in the human body?",
    "Describe the smell of fresh bread.",
    "What is a good name for a pet goldfish?",
    "How do bees make honey?",
    "Write an invitation to a birthday party.",
    "What language is spoken in Brazil?",
    "Explain why exercise is good for you.",
    "What is the tallest animal in the world?",
    "Give two reasons to read books.",
    "What is the freezing point of water in Fahrenheit?",
    "How do I say thank you politely in an email?",
    "What are the colours of the rainbow?",
    "Describe a sunset in one sentence.",
    "What is the purpose of a seatbelt?",
    "Recommend a game to play with friends on a rainy day.",
    "What is the moon made of?",
)


# Other general instructions, for replay during SFT (sft.replay_fraction): the model's own answers to these are
# mixed into the demonstrations. Disjoint from GENERAL_PROMPTS, which only ever measure.
REPLAY_PROMPTS = (
    "Write a limerick about a clumsy robot.",
    "What is the capital of Japan?",
    "Give me two ideas for a rainy weekend.",
    "Explain gravity to a child.",
    "Translate 'thank you' into French.",
    "What is the difference between a lake and a sea?",
    "Suggest a name for a coffee shop.",
    "Why do we have seasons?",
    "Write a short note asking a neighbour to keep the noise down.",
    "List three animals that live in the ocean.",
    "How do I make a cup of tea?",
    "What does a firefighter do?",
    "Describe a forest in the morning.",
    "What are the main parts of a plant?",
    "Write a one-sentence story about a lost key.",
    "Who painted the Mona Lisa?",
    "How can I be a better listener?",
    "Explain what a verb is.",
    "Give an example of a healthy snack.",
    "What is the smallest planet in our solar system?",
    "How can I keep my desk tidy?",
    "Write a short apology for being late to a meeting.",
    "What is the opposite of 'ancient'?",
    "Name three kinds of trees.",
    "Why does ice float on water?",
    "What should I bring on a hiking trip?",
    "Summarise the story of Little Red Riding Hood in two sentences.",
    "At what temperature does water freeze in Celsius?",
    "Suggest a hobby for someone who likes music.",
    "Explain what the internet is.",
    "Write a haiku about the rain.",
    "What is the main ingredient of bread?",
    "How many hours are there in a day?",
    "Give me a synonym for 'big'.",
    "What do the lungs do?",
    "Describe the sound of the sea.",
    "What is a good name for a puppy?",
    "How do birds fly?",
    "Write a short invitation to a picnic.",
    "What language is spoken in Mexico?",
    "Explain why sleep is important.",
    "What is the fastest land animal?",
    "Give two reasons to learn a second language.",
    "What is the boiling point of water in Fahrenheit?",
    "How do I politely decline an invitation?",
    "What are the primary colours?",
    "Describe a thunderstorm in one sentence.",
    "What is the purpose of a helmet?",
    "Recommend a board game for a family evening.",
    "What is the sun made of?",
)


@torch.no_grad()
def replay_demonstrations(model, tokenizer, prompts=REPLAY_PROMPTS, max_new_tokens: int = 64) -> list[dict]:
    """The model's own greedy answers to general instructions as chat demonstrations ({"messages": ...}): mixed
    into SFT (sft.replay_fraction), they hold its behaviour on everything that is not the task where it was."""
    out = []
    for row in reference_answers(model, tokenizer, prompts, max_new_tokens):
        text = tokenizer.decode(row["answer"], skip_special_tokens=True).strip()
        if text:
            out.append({"messages": [{"role": "user", "content": row["instruction"]},
                                     {"role": "assistant", "content": text}]})
    return out


@torch.no_grad()
def reference_answers(model, tokenizer, prompts=GENERAL_PROMPTS, max_new_tokens: int = 48) -> list[dict]:
    """The reference model's greedy answer to each prompt, as ids: [{"instruction", "prompt": ids, "answer": ids}]."""
    from agentrl.rollout.engine import encode_prompt
    from agentrl.rollout.sampling import SamplingParams, sample_batch

    contexts = [encode_prompt(tokenizer, tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                                       tokenize=False, add_generation_prompt=True))
                for p in prompts]
    params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=False)
    samples = sample_batch(model.eval(), contexts, params, tokenizer.eos_token_id, tokenizer.pad_token_id,
                           tokenizer=tokenizer)
    return [{"instruction": p, "prompt": c, "answer": s.ids} for p, c, s in zip(prompts, contexts, samples) if s.ids]


@torch.no_grad()
def _answer_logprobs(model, rows: list[dict]) -> list[torch.Tensor]:
    """Per row, (A, V) log-softmax of the model's next-token distribution at each answer token's position."""
    out = []
    for row in rows:  # one row at a time: 50 short rows, no padding to reason about
        ids = torch.tensor([row["prompt"] + row["answer"]], device=next(model.parameters()).device)
        logits = model(input_ids=ids).logits[0, len(row["prompt"]) - 1:-1].float()
        out.append(torch.log_softmax(logits, -1))
    return out


@torch.no_grad()
def retention_metrics(policy, rows: list[dict], reference_logprobs: list[torch.Tensor] | None = None) -> dict:
    """{"nll", "kl"} of `policy` on the reference's answers (kl only when the reference's logprobs are given)."""
    policy.eval()
    logprobs = _answer_logprobs(policy, rows)
    tokens = sum(len(r["answer"]) for r in rows)
    nll = -sum(lp.gather(1, torch.tensor(r["answer"], device=lp.device)[:, None]).sum().item()
               for lp, r in zip(logprobs, rows)) / tokens
    metrics = {"nll": round(nll, 4), "prompts": len(rows), "tokens": tokens}
    if reference_logprobs is not None:
        kl = sum((lp.exp() * (lp - ref)).sum().item() for lp, ref in zip(logprobs, reference_logprobs)) / tokens
        metrics["kl"] = round(kl, 4)
    return metrics


class Retention:
    """The reference's answers and logprobs, computed once; `measure(policy)` scores a policy against them."""

    def __init__(self, reference_dir: str, tokenizer=None, max_new_tokens: int = 48):
        from agentrl.jobs.evaluate import load_policy

        reference, ref_tokenizer = load_policy(reference_dir)
        self.rows = reference_answers(reference, tokenizer or ref_tokenizer, max_new_tokens=max_new_tokens)
        self.reference_logprobs = _answer_logprobs(reference, self.rows)
        self.reference = retention_metrics(reference, self.rows, self.reference_logprobs)
        del reference

    def measure(self, policy) -> dict:
        return retention_metrics(policy, self.rows, self.reference_logprobs)
