-- The person's decision an effect was admitted under (an approval request's id), if any: a
-- receipt then says not only what ran but who said it could.
ALTER TABLE effect_receipts ADD COLUMN approval_id TEXT;
