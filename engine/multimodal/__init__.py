"""Images in prompts: decoded and hashed (`images`), turned into a model's inputs and prompt tokens
(a family's processor, `processing`), their encoder outputs cached by content (`encoder_cache`) and
placed at their prompt positions in each step (`step_embeds`)."""
