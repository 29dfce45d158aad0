"""Patch TRL 0.11.4's tests/test_ppo_trainer.py to run against agentrl, offline, on local tiny models.

usage: patch_tests.py SRC DST MODELS_DIR [agentrl|trl]   (trl: the control run, imports left as TRL's)

Every substitution states how many times it must match, so a different source file fails loudly instead of
being half-patched. Nothing in the tests' logic or assertions is changed; the edits are:
  imports      trl -> agentrl, trl.core -> agentrl.core; `.testing_constants` imported as a top-level module
  model ids    the Hub ids (and "gpt2") -> local tiny random models built by build_models.py
  T5           setUp's load of the tiny T5 is removed (agentrl has no encoder-decoder models: its
               AutoModelForSeq2SeqLMWithValueHead raises by design, which would error every test in setUp);
               test_batched_forward_pass's "t5" case is skipped as not applicable
  tearDownClass  the Hub clean-up (delete_repo on hub-ci) swallows any exception, not only HTTPError:
               offline, huggingface_hub raises other exception types
"""

import re
import sys
from pathlib import Path

src, dst, models = sys.argv[1], sys.argv[2], Path(sys.argv[3]).resolve()
target = sys.argv[4] if len(sys.argv) > 4 else "agentrl"
text = Path(src).read_text()


def sub(pattern, repl, count, flags=0):
    global text
    text, n = re.subn(pattern, repl, text, flags=flags)
    if n != count:
        sys.exit(f"patch_tests.py: {pattern!r} matched {n} times, expected {count}")


if target == "agentrl":
    sub(r"^from trl import ", "from agentrl import ", 1, re.M)
    sub(r"^from trl\.core import ", "from agentrl.core import ", 1, re.M)
sub(r"^from \.testing_constants import ", "from testing_constants import ", 1, re.M)
sub(r'"trl-internal-testing/dummy-GPT2-correct-vocab"', f'"{models}/dummy-GPT2-correct-vocab"', 1)
sub(r'"trl-internal-testing/tiny-BloomForCausalLM-correct-vocab"',
    f'"{models}/tiny-BloomForCausalLM-correct-vocab"', 1)
sub(r'(from_pretrained\(\s*)"gpt2"', rf'\1"{models}/gpt2"', 5)
sub(r'( +)model_id = "trl-internal-testing/tiny-T5ForConditionalGeneration-correct-vocab"\n'
    r'\s*self\.t5_model = AutoModelForSeq2SeqLMWithValueHead\.from_pretrained\(model_id\)\n'
    r'\s*self\.t5_tokenizer = AutoTokenizer\.from_pretrained\(model_id\)\n',
    r"\1# [agentrl runner] T5 not loaded: agentrl has no encoder-decoder models\n"
    r"\1self.t5_model = self.t5_tokenizer = None\n", 1)
sub(r"(    def test_batched_forward_pass\(self, name\):\n)",
    r'\1        if name == "t5":\n'
    r'            pytest.skip("NOT APPLICABLE: encoder-decoder (T5): agentrl trains causal LMs only; no tiny T5 is built")\n', 1)
sub(r"except HTTPError:", "except Exception:  # [agentrl runner] offline", 1)

Path(dst).write_text(text)
