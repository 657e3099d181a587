package idempotency_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// chargeAtProvider stands for a payment provider's API, charged with key as
// its idempotency key.
func chargeAtProvider(_ context.Context, key string, amountCents int64) (*wrapperspb.StringValue, error) {
	return wrapperspb.String(fmt.Sprintf("ch_%s %d", key[:8], amountCents)), nil
}

// A handler that charges a provider records the provider's answer as a
// step: a re-run of the call (after a crash, or a retry of a call that
// failed after the charge) gets the recorded charge back, and does not
// call the provider again, even if the provider has forgotten the key.
func ExampleStep() {
	var store *idempotency.Store // idempotency.NewStore(pool), migrated
	handler := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		orderID, amountCents := "order-1", int64(100)
		charge, err := idempotency.Step(ctx, "charge "+orderID,
			func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
				return chargeAtProvider(ctx, key, amountCents) // key: EffectKey(ctx, "charge "+orderID)
			})
		if err != nil {
			return nil, err
		}
		_, err = tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ($1)`, charge.GetValue())
		return charge, err
	}
	if store != nil {
		if _, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "/shop.v1.Orders/Pay"}, handler); err != nil {
			log.Print(err)
		}
	}
}
