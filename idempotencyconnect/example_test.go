package idempotencyconnect_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"

	"connectrpc.com/connect"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// A connect handler whose charges are applied once per key, and a connect
// client that keeps one key for a call and its retries. The second call
// is the application sending the first again (its answer was lost, say)
// with the key the first used.
func Example() {
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
	if _, err := pool.Exec(ctx, `CREATE TABLE charges (id bigserial PRIMARY KEY, note text NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	// The server: the interceptor on the handler.
	serverIC, err := idempotencyconnect.NewHandlerInterceptor(store)
	if err != nil {
		log.Fatal(err)
	}
	charge := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		tx := idempotency.MustTxFromContext(ctx) // the call's transaction
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO charges (note) VALUES ($1) RETURNING id`, req.Msg.GetBody()).Scan(&id)
		return connect.NewResponse(&testingv1.Response{LedgerId: id}), err
	}
	mux := http.NewServeMux()
	mux.Handle("/idempotency.testing.v1.PolicyService/Required", connect.NewUnaryHandler(
		"/idempotency.testing.v1.PolicyService/Required", charge, connect.WithInterceptors(serverIC)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	// The client: the interceptor gives the call its key and retries it.
	clientIC, err := idempotencyconnect.NewClientInterceptor()
	if err != nil {
		log.Fatal(err)
	}
	client := connect.NewClient[testingv1.Request, testingv1.Response](srv.Client(),
		srv.URL+"/idempotency.testing.v1.PolicyService/Required", connect.WithInterceptors(clientIC))

	req := connect.NewRequest(&testingv1.Request{Body: "order 1001"})
	first, err := client.CallUnary(ctx, req)
	if err != nil {
		log.Fatal(err)
	}
	again, err := client.CallUnary(idempotency.WithOutgoingKey(ctx, idempotencyconnect.KeyOf(req)), connect.NewRequest(&testingv1.Request{Body: "order 1001"}))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("charge", first.Msg.GetLedgerId())
	fmt.Println("charge", again.Msg.GetLedgerId(), "replayed:", again.Trailer().Get(idempotency.ReplayedTrailer))
	// Output:
	// charge 1
	// charge 1 replayed: true
}
