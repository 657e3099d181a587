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
