package natsconsumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/exactlyonce/idempotency"
)

// Credit is the example's message: add AmountCents to an account's balance.
// It travels as JSON.
type Credit struct {
	Account     string `json:"account"`
	AmountCents int64  `json:"amount_cents"`
}

// CreditTables is the SQL of the example's tables: one row per applied
// credit and one balance per account. account_credits.msg_id is deliberately
// not unique, so that a credit applied twice would show as two rows; a real
// schema may well add the constraint as a second line of defence.
const CreditTables = `
CREATE TABLE IF NOT EXISTS account_credits (
	msg_id       text        NOT NULL,
	account_id   text        NOT NULL,
	amount_cents bigint      NOT NULL,
	applied_at   timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS account_balances (
	account_id    text   PRIMARY KEY,
	balance_cents bigint NOT NULL
);`

// CreateCreditTables runs [CreditTables] on db, a pool or a connection.
func CreateCreditTables(ctx context.Context, db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}) error {
	if _, err := db.Exec(ctx, CreditTables); err != nil {
		return fmt.Errorf("natsconsumer: create credit tables: %w", err)
	}
	return nil
}

// ApplyCredit is the example's [Handler]: it records the credit and adds it
// to the account's balance, both through tx. A message that is not a valid
// Credit is rejected for good with [idempotency.Final].
func ApplyCredit(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error {
	var c Credit
	if err := json.Unmarshal(msg.Data(), &c); err != nil {
		return idempotency.Final(fmt.Errorf("credit %s: %w", id, err))
	}
	if c.Account == "" || c.AmountCents <= 0 {
		return idempotency.Final(errors.New("credit " + id + ": needs an account and a positive amount"))
	}
	if _, err := tx.Exec(ctx, `INSERT INTO account_credits (msg_id, account_id, amount_cents) VALUES ($1, $2, $3)`,
		id, c.Account, c.AmountCents); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO account_balances (account_id, balance_cents) VALUES ($1, $2)
ON CONFLICT (account_id) DO UPDATE SET balance_cents = account_balances.balance_cents + EXCLUDED.balance_cents`,
		c.Account, c.AmountCents)
	return err
}
