package idempotency_test

import (
	"context"
	"fmt"
	"log"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A unit test of a handler that writes through the call's transaction:
// no server and no network, the interceptor called as the function it is,
// with the key in the incoming metadata as a client would send it. The
// handler gets the transaction, the key and derived keys exactly as in
// production, against the test's database; a second call with the key is
// a replay.
func ExampleUnaryServerInterceptor_testingAHandler() {
	ctx := context.Background()
	pool, done := testdb.ForExample(ctx)
	defer done()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE cards (id bigserial PRIMARY KEY, name text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	// The handler under test, as the generated code would call it.
	sendCard := func(ctx context.Context, req any) (any, error) {
		tx := idempotency.MustTxFromContext(ctx)
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO cards (name) VALUES ($1) RETURNING id`, req.(*wrapperspb.StringValue).GetValue()).Scan(&id)
		return wrapperspb.Int64(id), err
	}

	intercept := idempotency.UnaryServerInterceptor(store, idempotency.WithKeyRequired())
	info := &grpc.UnaryServerInfo{FullMethod: "/greeter.v1.GreeterService/SendCard"}
	call := metadata.NewIncomingContext(ctx, metadata.Pairs(idempotency.MetadataKey, "card-for-ada"))
	for range 2 {
		resp, err := intercept(call, wrapperspb.String("Ada"), info, sendCard)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println("card", resp.(*wrapperspb.Int64Value).GetValue())
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM cards`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("cards:", n)
	// Output:
	// card 1
	// card 1
	// cards: 1
}
