package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// One key for every attempt of a request: the provider's first answer is a
// 503 (HTTPMiddleware releases the key), and the retry under the same key
// is charged once.
func ExampleHTTPClient() {
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
	var keys []string
	provider := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys = append(keys, r.Header.Get(idempotency.HeaderKey))
		if len(keys) == 1 {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"charge":1}`)
	})))
	defer provider.Close()

	hc := &idempotency.HTTPClient{BackoffBase: 10 * time.Millisecond}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL+"/v1/charges", strings.NewReader(`{"cents":100}`))
	if err != nil {
		log.Fatal(err)
	}
	resp, err := hc.Do(req)
	var failed *idempotency.HTTPRetryError
	if errors.As(err, &failed) {
		log.Fatalf("no answer; send it again later under key %s: %v", failed.Key, err)
	} else if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, string(body))
	fmt.Println("attempts:", len(keys), "one key:", keys[0] == keys[1] && keys[0] == resp.Request.Header.Get(idempotency.HeaderKey))
	// Output:
	// 201 {"charge":1}
	// attempts: 2 one key: true
}

// A named effect: the provider's charge of an order has one key, whatever
// else the handler calls and in whatever order. The first run makes an
// extra call (a quote, an effect of its own) before the charge and then
// fails (the key is released); the second run does not, and its charge
// gets the provider's first answer.
func ExampleWithEffect() {
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
	charged := 0
	provider := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charged++
		fmt.Fprintf(w, "provider charge %d", charged)
	})))
	defer provider.Close()

	hc := &idempotency.HTTPClient{}
	post := func(ctx context.Context, path string) (string, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL+path, strings.NewReader(`{"cents":100}`))
		if err != nil {
			return "", err
		}
		resp, err := hc.Do(req) // one key for all of its attempts
		var unreachable *idempotency.HTTPRetryError
		if errors.As(err, &unreachable) {
			return "", status.Errorf(codes.Unavailable, "provider: %v", err)
		} else if err != nil {
			return "", err // refused before sending: a configuration error
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return string(body), nil
	}
	call := idempotency.Call{Scope: "tenant-1", Key: "order-1001", Method: "checkout"}
	for run := 1; run <= 2; run++ {
		_, err := store.Execute(ctx, call, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			if run == 1 {
				if _, err := post(idempotency.WithEffect(ctx, "quote order-1001"), "/v1/quotes"); err != nil { // made on this run only
					return nil, err
				}
			}
			// One name, one key: the same on every run and every retry.
			body, err := post(idempotency.WithEffect(ctx, "charge order-1001"), "/v1/charges")
			if err != nil {
				return nil, err
			}
			fmt.Println("run", run, "got", body)
			if run == 1 {
				return nil, status.Error(codes.Unavailable, "the ledger is down: nothing committed, the key is released")
			}
			return wrapperspb.String(body), nil
		})
		fmt.Println("run", run, "ended", status.Code(err))
	}
	// Output:
	// run 1 got provider charge 2
	// run 1 ended Unavailable
	// run 2 got provider charge 2
	// run 2 ended OK
}
