package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Routes of the HTTP server: the same handler, through the middleware
// (http-fresh) and without it (http-plain).
const (
	routeIdempotent = "/idempotent/ledger"
	routePlain      = "/plain/ledger"
)

// ledgerRequest and ledgerResponse are the JSON forms of the trivial
// handler's request and response.
type ledgerRequest struct {
	Body   string `json:"body"`
	Amount int64  `json:"amount"`
}

type ledgerResponse struct {
	LedgerID int64  `json:"ledger_id"`
	Body     string `json:"body"` // -response-bytes long
}

// httpServer is the net/http server on a loopback port that serves both
// routes; outcomes counts the middleware's outcomes.
type httpServer struct {
	addr     string
	srv      *http.Server
	outcomes *outcomeCounts
}

// startHTTPServer serves the trivial handler as JSON, its write in the
// request's transaction under the middleware, else in a transaction of its
// own: the same as service.serve does for gRPC.
func startHTTPServer(pool *pgxpool.Pool, h *handler, store *idempotency.Store, outcomes *outcomeCounts) (*httpServer, error) {
	s := &httpServer{outcomes: outcomes}
	ledger := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in ledgerRequest
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		ctx, req := r.Context(), &testingv1.Request{Body: in.Body, Amount: in.Amount}
		var resp *testingv1.Response
		var err error
		if tx, ok := idempotency.TxFromContext(ctx); ok {
			resp, err = h.write(ctx, tx, req)
		} else {
			resp, err = runPlain(ctx, pool, h, req)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		out, err := json.Marshal(ledgerResponse{LedgerID: resp.GetLedgerId(), Body: resp.GetBody()})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(out)
	})
	mw := idempotency.HTTPMiddleware(store) // its outcomes are counted by store's tracer
	mux := http.NewServeMux()
	mux.Handle("POST "+routeIdempotent, mw(ledger))
	mux.Handle("POST "+routePlain, ledger)
	s.srv = &http.Server{Handler: mux, ReadHeaderTimeout: time.Minute}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s.addr = lis.Addr().String()
	go func() { _ = s.srv.Serve(lis) }()
	return s, nil
}

// newHTTPClient is one bench client's: a transport of its own, so that it
// keeps one connection of its own alive, as each client has its own gRPC
// connection. The transport has no idle timeout, so no run reconnects.
func newHTTPClient() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
}

// postHTTP is one call of an HTTP variant: the request's JSON, with the key
// when there is one, then the whole response read, so the connection is
// reused.
func (c *client) postHTTP(ctx context.Context, url, key string, req *testingv1.Request) error {
	body, err := json.Marshal(ledgerRequest{Body: req.GetBody(), Amount: req.GetAmount()})
	if err != nil {
		return err
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	hr.Header.Set("Content-Type", "application/json")
	if key != "" {
		hr.Header.Set(idempotency.HeaderKey, key)
	}
	resp, err := c.http.Do(hr)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	var out ledgerResponse
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return fmt.Errorf("decode the response: %w", err)
	}
	_, err = io.Copy(io.Discard, resp.Body)
	return err
}
