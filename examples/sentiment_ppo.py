"""TRL 0.11's sentiment example (gpt2-sentiment), written against agentrl: PPO makes a causal LM continue
review openings so that a sentiment classifier finds them positive.

    agentrl base-model --out runs/base-model        # any causal LM directory works
    python examples/sentiment_ppo.py --model runs/base-model --steps 20

As in TRL's example: query lengths and response lengths drawn by `LengthSampler`, the classifier's POSITIVE
score as the reward (a `text-classification` pipeline), reference responses generated next to the policy's
(`generate_ref_response=True`) and scored too, and `log_stats(..., columns_to_log=...)` with those columns.
Nothing is downloaded: the reviews are made up here and the classifier is a tiny one trained on them in a few
seconds, standing in for lvwerra/distilbert-imdb.
"""

from __future__ import annotations

import argparse
import random

import torch
from datasets import Dataset
from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification, pipeline

from agentrl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed
from agentrl.core import LengthSampler

POSITIVE = "good great lovely wonderful fun best".split()
NEGATIVE = "bad awful boring terrible dull worst".split()
FILLER = "the movie was a story and its plot actor ending film this it".split()


def reviews(n: int, seed: int = 0) -> list[dict]:
    """Made-up reviews; label 1 when the sentiment words in it are positive."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = POSITIVE if i % 2 else NEGATIVE
        text = " ".join(rng.choice(words) if rng.random() < 0.3 else rng.choice(FILLER) for _ in range(24))
        rows.append({"review": text, "label": i % 2})
    return rows


def train_sentiment_classifier(tokenizer, rows: list[dict], steps: int = 60, seed: int = 0):
    """A 1-layer GPT-2 sequence classifier (NEGATIVE/POSITIVE) fitted on `rows`: the reward model."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=512, num_labels=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, id2label={0: "NEGATIVE", 1: "POSITIVE"},
                        label2id={"NEGATIVE": 0, "POSITIVE": 1})
    model = GPT2ForSequenceClassification(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        batch = [rows[(step * 16 + i) % len(rows)] for i in range(16)]
        # random cuts, so that short texts (query + response) are classified as well as whole reviews
        texts = [" ".join(r["review"].split()[: random.randint(3, 24)]) for r in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True)
        loss = model(**inputs, labels=torch.tensor([r["label"] for r in batch])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def main(model_path: str, steps: int = 20, batch_size: int = 16, mini_batch_size: int = 8, seed: int = 0,
         learning_rate: float = 1e-4) -> list[dict]:
    config = PPOConfig(model_name=model_path, learning_rate=learning_rate, batch_size=batch_size,
                       mini_batch_size=mini_batch_size, ppo_epochs=2, seed=seed)
    set_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    rows = reviews(max(steps, 1) * batch_size, seed)
    input_size = LengthSampler(2, 8)

    def tokenize(sample):
        sample["input_ids"] = tokenizer.encode(sample["review"])[: input_size()]
        sample["query"] = tokenizer.decode(sample["input_ids"])
        return sample

    dataset = Dataset.from_list(rows).map(tokenize)
    dataset.set_format(type="torch")

    def collator(data):
        return {key: [d[key] for d in data] for key in data[0]}

    model = AutoModelForCausalLMWithValueHead.from_pretrained(model_path)
    ref_model = AutoModelForCausalLMWithValueHead.from_pretrained(model_path)
    ppo_trainer = PPOTrainer(config, model, ref_model, tokenizer, dataset=dataset, data_collator=collator)

    classifier = train_sentiment_classifier(tokenizer, rows, seed=seed)
    sentiment_pipe = pipeline("text-classification", model=classifier, tokenizer=tokenizer, device="cpu")
    sent_kwargs = {"top_k": None, "function_to_apply": "none", "batch_size": 16}

    def positive_scores(texts: list[str]) -> list[torch.Tensor]:
        return [torch.tensor(next(s["score"] for s in out if s["label"] == "POSITIVE"))
                for out in sentiment_pipe(texts, **sent_kwargs)]

    gen_kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True,
                  "pad_token_id": tokenizer.eos_token_id}
    output_length_sampler = LengthSampler(4, 16)
    history = []
    for step, batch in enumerate(ppo_trainer.dataloader):
        if step >= steps:
            break
        query_tensors = batch["input_ids"]
        response_tensors, ref_response_tensors = ppo_trainer.generate(
            query_tensors, return_prompt=False, generate_ref_response=True, length_sampler=output_length_sampler,
            **gen_kwargs)
        batch["response"] = tokenizer.batch_decode(response_tensors)
        batch["ref_response"] = tokenizer.batch_decode(ref_response_tensors)

        rewards = positive_scores([q + r for q, r in zip(batch["query"], batch["response"])])
        batch["ref_rewards"] = positive_scores([q + r for q, r in zip(batch["query"], batch["ref_response"])])

        stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
        ppo_trainer.log_stats(stats, batch, rewards, columns_to_log=["query", "response", "ref_response", "ref_rewards"])
        history.append({"reward": torch.stack(rewards).mean().item(),
                        "ref_reward": torch.stack(batch["ref_rewards"]).mean().item(),
                        "kl": stats["objective/kl"]})
        print(f"step {step}: reward {history[-1]['reward']:.3f} (reference {history[-1]['ref_reward']:.3f}), "
              f"KL {history[-1]['kl']:.3f}")
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/base-model", help="a causal LM directory")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--mini_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    args = parser.parse_args()
    main(args.model, args.steps, args.batch_size, args.mini_batch_size, learning_rate=args.learning_rate)
